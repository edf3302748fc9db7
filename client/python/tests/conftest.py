"""Fixtures: a real kvferryd on free loopback ports (as tests/integration/daemon_harness.h
starts it), Clients connected to it, and the golden vectors of tests/data/kv-formats.

The environment, read only here: KVFERRY_DAEMON (the kvferryd binary; ctest sets it),
KVFERRY_GOLDEN_DIR (default: the checkout's tests/data/kv-formats), KVFERRY_TEST_DEVICE
(the pools' device, default cpu).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time

import numpy as np
import pytest

import kvferry

REPO = pathlib.Path(__file__).resolve().parents[3]

# True once kvferryd sends the kvferry-error-reason trailer with every error; until then
# a missing trailer skips the reason assertion (and says so) instead of failing.
REASONS_REQUIRED = True


def expect_reason(error: kvferry.Error, reason: str) -> None:
    """Asserts the error's reason; call it last in a test (it may skip)."""
    if not error.reason and not REASONS_REQUIRED:
        pytest.skip(f"kvferryd sent no {kvferry.REASON_KEY} trailer (expected {reason}); "
                    "set REASONS_REQUIRED in conftest.py once it does")
    assert error.reason == reason, error


def device() -> str:
    return os.environ.get("KVFERRY_TEST_DEVICE") or "cpu"


class Daemon:
    """A kvferryd process on 127.0.0.1 with OS-chosen ports; SIGKILLed by stop()."""

    def __init__(self, *flags: str):
        binary = os.environ.get("KVFERRY_DAEMON")
        if not binary:
            raise RuntimeError("set KVFERRY_DAEMON to the kvferryd binary (ctest does)")
        self.dir = tempfile.mkdtemp(prefix="kvferryd-pytest-")
        port_file = os.path.join(self.dir, "ports")
        self.process = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
             f"--port_file={port_file}", "--log_level=warn", *flags])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with open(port_file) as f:
                    ports = f.read().split()
                if len(ports) == 2:
                    self.grpc_port, self.metrics_port = int(ports[0]), int(ports[1])
                    self.address = f"127.0.0.1:{self.grpc_port}"
                    return
            except FileNotFoundError:
                pass
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"kvferryd exited during start-up ({self.process.returncode})")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("kvferryd did not start within 30 s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def daemon():
    """A fresh kvferryd for one test."""
    d = Daemon()
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    with kvferry.Client(daemon.address, timeout=60) as c:
        yield c


class GoldenCase:
    """One folder of tests/data/kv-formats."""

    def __init__(self, folder: pathlib.Path):
        self.name = folder.name
        self.folder = folder
        meta = json.loads((folder / "case.json").read_text())
        self.page_size, self.num_pages = meta["page_size"], meta["num_pages"]
        self.layouts = meta["layouts"]  # {"v4": {"page_bytes": ...}, ...}
        self.rows = np.fromfile(folder / "input.bf16", dtype=np.uint16).reshape(-1, 512)
        self.locs = np.fromfile(folder / "locs.i64", dtype=np.int64)

    def bytes(self, name: str) -> bytes:
        return (self.folder / name).read_bytes()

    def array(self, name: str) -> np.ndarray:
        return np.fromfile(self.folder / name, dtype=np.uint16).reshape(-1, 512)


def golden_cases() -> list[GoldenCase]:
    root = pathlib.Path(os.environ.get("KVFERRY_GOLDEN_DIR") or REPO / "tests/data/kv-formats")
    return [GoldenCase(f) for f in sorted(root.iterdir()) if (f / "case.json").exists()]


LAYOUTS = {"v4": kvferry.Layout.V4, "v41": kvferry.Layout.V41, "v41_fp4": kvferry.Layout.V41_FP4}


def random_rows(n: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """bf16 bits [n, 512] of finite normal values (float32 truncated to bf16)."""
    values = np.random.default_rng(seed).normal(0, scale, (n, 512)).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16)
