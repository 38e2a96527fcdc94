"""Protocol buffer definitions and their generated Python code.

Regenerate after editing any ``.proto`` here with ``python -m protos.generate`` (never edit the
``*_pb2*.py`` files by hand; ``tests/kv_transfer/test_protos.py`` fails when they are stale).
"""
