"""A real Prometheus scrapes a real kvferryd (cpu backend) while the kvferry command drives
traffic; then every query of the Grafana dashboard and of the rules file must return data,
every rule must evaluate without error, and every metric they name must be one the daemon
exports.

Environment (set by CMake): KVFERRY_DAEMON, KVFERRY_CLI, KVFERRY_DEPLOY_DIR, PROMETHEUS, and
PYTHONPATH with the generated stubs (the KV cache has no command yet: its traffic goes
through kvferry.v1.cache_pb2_grpc).
"""
import json
import math
import os
import re
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import grpc
import pytest
import yaml
from kvferry.v1 import cache_pb2, cache_pb2_grpc

DEPLOY = os.environ.get("KVFERRY_DEPLOY_DIR", "")
DAEMON = os.environ.get("KVFERRY_DAEMON", "")
CLI = os.environ.get("KVFERRY_CLI", "")
PROMETHEUS = os.environ.get("PROMETHEUS", "/usr/bin/prometheus")

# Metrics that cannot have a sample on the cpu backend, and why. A query naming one of them
# must return NOTHING here (so that the day the cpu backend exports one, this list is
# corrected rather than silently hiding a broken query).
CPU_ABSENT = {
    "kvferry_session_transfers_total": "CUDA IPC Save/Load need the cuda backend",
    "kvferry_session_transfer_bytes_total": "CUDA IPC Save/Load need the cuda backend",
    "kvferry_session_transfer_seconds": "CUDA IPC Save/Load need the cuda backend",
}
# Recorded series built only from those metrics.
CPU_ABSENT_RECORDS = {"kvferry:session_transfer_bytes:rate5m",
                      "kvferry:session_transfer_error_ratio:rate5m"}

# Grafana's variables, as the dashboard would expand them for one daemon.
RATE_INTERVAL = "1m"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def wait_for(predicate, what, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {seconds}s waiting for {what}")


def stop(process):
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Stack:
    """kvferryd with a config file, and Prometheus scraping it every second."""

    def __init__(self, tmp):
        self.tmp = tmp
        config = tmp / "kvferryd.toml"
        config.write_text(
            'log_level = "warn"\n'
            "max_pools = 4\n"   # the pools below and bench's: one more is refused
            "[[pool]]\nname = \"lat\"\nlayout = \"v41\"\npage_size = 16\nnum_pages = 64\n"
            "num_layers = 2\ndevice = \"cpu\"\n"
            "[[pool]]\nname = \"tiny\"\nlayout = \"v41_fp4\"\npage_size = 16\nnum_pages = 2\n"
            "device = \"cpu\"\n"
            "[[pool]]\nname = \"cache\"\nlayout = \"v41\"\npage_size = 16\nnum_pages = 8\n"
            "device = \"cpu\"\n")
        self.waves = 0
        ports = tmp / "ports"
        self.daemon = subprocess.Popen(
            [DAEMON, "--config", str(config), "--listen=127.0.0.1:0",
             "--metrics_listen=127.0.0.1:0", f"--port_file={ports}"],
            stdin=subprocess.DEVNULL)
        wait_for(lambda: ports.exists() and len(ports.read_text().split()) == 2, "kvferryd")
        self.grpc_port, self.metrics_port = map(int, ports.read_text().split())
        self.instance = f"127.0.0.1:{self.metrics_port}"
        self.prom_port = free_port()
        prom_config = tmp / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [os.path.join(DEPLOY, "prometheus", "kvferry-rules.yml")],
            "scrape_configs": [{"job_name": "kvferryd",
                                "static_configs": [{"targets": [self.instance]}]}],
        }))
        self.prometheus = subprocess.Popen(
            [PROMETHEUS, f"--config.file={prom_config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.prom_port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(tmp / "prometheus.log", "w"))
        wait_for(lambda: "Ready" in http_get(f"http://127.0.0.1:{self.prom_port}/-/ready"),
                 "prometheus")

    def close(self):
        stop(self.prometheus)
        stop(self.daemon)

    def query(self, expr):
        url = (f"http://127.0.0.1:{self.prom_port}/api/v1/query?" +
               urllib.parse.urlencode({"query": expr}))
        try:
            body = json.loads(http_get(url))
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{expr}: {error.read().decode()}") from None
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def kvferry(self, *args, fails_with=None):
        """Runs the command; it must succeed, or fail (exit 1) with the error reason given."""
        run = subprocess.run([CLI, "--target", f"127.0.0.1:{self.grpc_port}", *map(str, args)],
                             capture_output=True, text=True, timeout=120)
        if fails_with is None:
            assert run.returncode == 0, (args, run.returncode, run.stderr)
        else:
            assert run.returncode == 1 and fails_with in run.stderr, (args, run.returncode, run.stderr)
        return run

    def traffic(self):
        """Every data rpc, successes and failures (a missing pool, a full pool)."""
        tokens = 32
        pages = self.tmp / "pages.json"
        self.kvferry("pages", "alloc", "lat", 2, "--out", pages)
        rows = self.tmp / "rows.bf16"
        # bf16 rows [tokens, 512] of small finite values.
        values = [0x3F80, 0xBF00, 0x3E00, 0x0000, 0x4000]
        rows.write_bytes(b"".join(values[(i * 7) % 5].to_bytes(2, "little")
                                  for i in range(tokens * 512)))
        locs = self.tmp / "locs.i64"
        locs.write_bytes(b"".join(i.to_bytes(8, "little") for i in range(tokens)))
        for layer in (0, 1):
            self.kvferry("put", "lat", "--pages", pages, "--layer", layer, "--rows", rows,
                         "--locs", locs)
        self.kvferry("get-pages", "lat", "--pages", pages, "--layers", 0, "--transcode-to", "v4",
                     "--out", self.tmp / "out.bin")
        self.kvferry("get-workspace", "lat", "--pages", pages, "--layer", 1, "--locs", locs,
                     "--out", self.tmp / "ws.bin")
        self.kvferry("stats")
        self.kvferry("health")
        for layout in ("v4", "v41", "v41_fp4"):
            self.kvferry("bench", "--tokens", 2048, "--layout", layout, "--page-size", 64,
                         "--device", "cpu")
        # A fifth pool is over the daemon's budget (max_pools).
        self.kvferry("pool", "create", "extra", "--layout", "v4", "--page-size", 16, "--pages", 1,
                     "--device", "cpu")
        self.kvferry("pool", "create", "extra2", "--layout", "v4", "--page-size", 16, "--pages",
                     1, "--device", "cpu", fails_with="DAEMON_BUDGET_EXHAUSTED")
        self.kvferry("pool", "delete", "extra")
        # A push to a peer that is not there (kvferry_peer_transfer_failures_total).
        self.kvferry("push", "lat", "--pages", pages, "--to", "127.0.0.1:1", "--to-pool", "lat",
                     "--to-pages", pages, fails_with="PEER_UNAVAILABLE")
        self.cache_traffic()
        missing = self.tmp / "missing.json"
        self.kvferry("pages", "alloc", "no-such-pool", 1, "--out", missing,
                     fails_with="POOL_NOT_FOUND")
        self.kvferry("pages", "alloc", "tiny", 3, "--out", missing, fails_with="POOL_FULL")


    def cache_traffic(self):
        """A namespace of two blocks filled with three (an eviction), lookups that hit and
        miss, a lease released and one left to expire."""
        self.waves += 1
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            cache = cache_pb2_grpc.KvCacheStub(channel)
            ns = cache.CreateNamespace(cache_pb2.CreateNamespaceRequest(
                name=f"ns{self.waves}", model_fingerprint="model", layer_group="all",
                tenant_salt=b"salt", block_tokens=16, pools=["cache"], max_blocks=2), timeout=30)
            rows = bytes(16 * 512 * 2)   # one block of zero rows

            def put(key):
                first = cache_pb2.PutRowsRequest(namespace=ns.name, digest=ns.digest,
                                                 pool="cache", key=key, layer=0, rows=rows,
                                                 finish_write=True)
                return cache.PutRows(iter([first]), timeout=30)
            for key in (b"k1", b"k2", b"k3"):
                assert put(key).blocks_stored == 1
            hit = cache.Lookup(cache_pb2.LookupRequest(
                namespace=ns.name, digest=ns.digest, keys=[b"k2", b"k3"], lease_ttl_ms=200),
                timeout=30)
            assert hit.hit_blocks == 2 and hit.lease_id != 0
            miss = cache.Lookup(cache_pb2.LookupRequest(
                namespace=ns.name, digest=ns.digest, keys=[b"absent"]), timeout=30)
            assert miss.hit_blocks == 0
            released = cache.Lookup(cache_pb2.LookupRequest(
                namespace=ns.name, digest=ns.digest, keys=[b"k3"], lease_ttl_ms=60000),
                timeout=30)
            cache.ReleaseLease(cache_pb2.ReleaseLeaseRequest(
                namespace=ns.name, lease_id=released.lease_id), timeout=30)
        time.sleep(0.5)   # the first lease runs out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    for path, name in ((DAEMON, "KVFERRY_DAEMON"), (CLI, "KVFERRY_CLI"), (PROMETHEUS, "PROMETHEUS")):
        assert path and os.access(path, os.X_OK), f"{name} ({path!r}) is not an executable"
    s = Stack(tmp_path_factory.mktemp("observability"))
    try:
        # Counters appear on their first increment: a rate needs a second, higher sample.
        s.traffic()
        wait_for(lambda: s.query(f'kvferry_rpc_requests_total{{instance="{s.instance}"}}'),
                 "the first scrape of the traffic")
        s.traffic()
        time.sleep(3)  # scraped, and the rules evaluated, after the second wave
        yield s
    finally:
        s.close()


def dashboard_queries():
    with open(os.path.join(DEPLOY, "grafana", "kvferry-dashboard.json")) as f:
        dashboard = json.load(f)
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            out.append((panel["title"], target["expr"]))
    return out


def rule_queries():
    """(name, query) for each recorded series, each recording rule's and alert's query."""
    with open(os.path.join(DEPLOY, "prometheus", "kvferry-rules.yml")) as f:
        rules = yaml.safe_load(f)
    out = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            expr = " ".join(rule["expr"].split())
            if "record" in rule:
                out.append((rule["record"], expr))
                out.append((rule["record"] + " (recorded)", rule["record"]))
                continue
            # An alert is `<query> <op> <number>` or `absent(<query>)` (the rules file's
            # convention); its query must return data on a healthy daemon.
            absent = re.fullmatch(r"absent\((.*)\)", expr)
            compared = re.fullmatch(r"(.*?)\s*(?:==|!=|>=|<=|>|<)\s*-?[0-9.]+(?:e-?[0-9]+)?", expr)
            assert absent or compared, f"alert {rule['alert']}: {expr} breaks the convention"
            out.append((rule["alert"], (absent or compared).group(1)))
    return out


def expand(expr, instance):
    return expr.replace("$instance", instance).replace("$__rate_interval", RATE_INTERVAL)


def cpu_absent(expr):
    return any(m in expr for m in CPU_ABSENT) or any(r in expr for r in CPU_ABSENT_RECORDS)


def finite(result):
    return [r for r in result if math.isfinite(float(r["value"][1]))]


@pytest.mark.parametrize("title,expr", dashboard_queries(), ids=lambda v: v[:60])
def test_dashboard_query_returns_data(stack, title, expr):
    result = stack.query(expand(expr, stack.instance))
    if cpu_absent(expr):
        assert result == [], f"{title}: exported on cpu now; drop it from CPU_ABSENT"
    else:
        assert finite(result), f"{title}: {expr} returned {result}"


@pytest.mark.parametrize("name,expr", rule_queries(), ids=lambda v: v[:60])
def test_rule_query_returns_data(stack, name, expr):
    result = stack.query(expr)
    if cpu_absent(expr):
        assert result == [], f"{name}: exported on cpu now; drop it from CPU_ABSENT"
    else:
        assert finite(result), f"{name}: {expr} returned {result}"


def test_every_rule_evaluates_without_error(stack):
    groups = json.loads(http_get(
        f"http://127.0.0.1:{stack.prom_port}/api/v1/rules"))["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == sum(1 for _ in rule_queries() if not _[0].endswith("(recorded)"))
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))


def test_no_alert_fires_on_a_healthy_daemon(stack):
    # The traffic's failures are the caller's (NOT_FOUND, POOL_FULL on a 2-page pool): the
    # server-error alert must stay quiet; KvferryPoolFull is pending at most (for: 5m).
    alerts = json.loads(http_get(
        f"http://127.0.0.1:{stack.prom_port}/api/v1/alerts"))["data"]["alerts"]
    assert [a for a in alerts if a["state"] == "firing"] == []
    assert {a["labels"]["alertname"] for a in alerts} <= {"KvferryPoolFull", "KvferryPoolNearlyFull"}


def test_every_metric_named_is_exported(stack):
    exported = set(re.findall(r"^# TYPE (\S+)", http_get(
        f"http://{stack.instance}/metrics"), re.M))
    named = set()
    for _, expr in dashboard_queries() + rule_queries():
        named |= set(re.findall(r"\bkvferry_[a-z0-9_]+", expr))
    for name in sorted(named):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in exported or base in exported, f"{name} is not a metric kvferryd exports"
    assert set(CPU_ABSENT) <= exported
