from __future__ import annotations


def pytest_configure(config):
    # The receiver views immutable payload bytes with torch.frombuffer and only reads them.
    config.addinivalue_line("filterwarnings", "ignore:The given buffer is not writable:UserWarning")
