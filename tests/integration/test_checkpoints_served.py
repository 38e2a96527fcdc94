"""Checkpoints as users bring them, served: one saved by transformers 5 (chat template in
chat_template.jinja) chats through the server; a broken GGUF is refused at start-up, before
anything is served."""

from __future__ import annotations

import pytest

from cluster.controller import ClusterStartError
from cluster.launcher import stop_cluster
from tests.engine.checkpoints import make_checkpoint, save_tokenizer_with_transformers
from tests.integration.conftest import start


def test_a_transformers_5_checkpoint_chats_through_the_server(ray_session, tmp_path):
    make_checkpoint(tmp_path / "tiny-v5", "llama")
    save_tokenizer_with_transformers(tmp_path / "tiny-v5")
    cluster = start({"model": str(tmp_path / "tiny-v5"), "engine": {"num_kv_blocks": 64}})
    try:
        import openai

        url = cluster.urls["http"] + "/v1"
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-v5"]
        reply = client.chat.completions.create(
            model="tiny-v5",
            messages=[{"role": "user", "content": "w5 w6"}],
            max_tokens=4,
            temperature=0,
        )
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.role == "assistant"
    finally:
        stop_cluster(cluster)


def test_a_truncated_gguf_is_refused_at_start(ray_session, tmp_path, default_model_file):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(default_model_file.read_bytes()[:50_000_000])
    message = r"^(decode|prefill)-0 could not start: CheckpointError: .*broken.gguf is not a readable GGUF"
    with pytest.raises(ClusterStartError, match=message):
        start({"model": str(broken), "engine": {"num_kv_blocks": 64}})
