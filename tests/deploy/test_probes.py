"""The commands of the deployment files, run as their runtimes would run them, against a
real kvferryd: the Containerfile's HEALTHCHECK command; the Kubernetes sidecar's
startup/readiness exec probe and HTTPS liveness probe against kvferryd serving TLS with the
manifest's own arguments (certificate paths moved to a temporary folder); the systemd unit's
ExecStartPre and ExecStart with the example config.

Environment (set by CMake): KVFERRY_DEPLOY_DIR, KVFERRY_DAEMON, KVFERRY_CLI.
"""
import hashlib
import json
import os
import re
import signal
import ssl
import subprocess
import time
import urllib.request

import pytest
import yaml

DEPLOY = os.environ.get("KVFERRY_DEPLOY_DIR", "")
DAEMON = os.environ.get("KVFERRY_DAEMON", "")
CLI = os.environ.get("KVFERRY_CLI", "")


def start(tmp, *flags):
    ports = tmp / "ports"
    process = subprocess.Popen([DAEMON, "--listen=127.0.0.1:0", f"--port_file={ports}",
                                "--log_level=warn", *flags], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ports.exists() and len(ports.read_text().split()) == 2:
            return process, [int(p) for p in ports.read_text().split()]
        assert process.poll() is None, f"kvferryd exited with {process.returncode}"
        time.sleep(0.05)
    process.kill()
    raise AssertionError("kvferryd did not start")


def stop(process):
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def healthcheck_command():
    with open(os.path.join(DEPLOY, "Containerfile")) as f:
        text = f.read().replace("\\\n", " ")
    match = re.search(r"^HEALTHCHECK .*?\bCMD (.*)$", text, re.M)
    assert match, "the Containerfile has no HEALTHCHECK ... CMD"
    return match.group(1)


def test_containerfile_healthcheck_passes_on_a_serving_daemon_and_fails_on_a_stopped_one(tmp_path):
    daemon, (grpc_port, _) = start(tmp_path, "--metrics_listen=")
    env = dict(os.environ, PATH=os.path.dirname(CLI) + ":" + os.environ["PATH"],
               KVFERRY_HEALTH_TARGET=f"127.0.0.1:{grpc_port}", KVFERRY_HEALTH_ARGS="")
    command = healthcheck_command()
    try:
        r = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, (command, r.stdout, r.stderr)
    finally:
        stop(daemon)
    r = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, (command, r.stdout, r.stderr)


def sidecar():
    with open(os.path.join(DEPLOY, "k8s", "kvferry-sidecar.yaml")) as f:
        deployment = [d for d in yaml.safe_load_all(f) if d and d["kind"] == "Deployment"][0]
    spec = deployment["spec"]["template"]["spec"]
    return [c for c in spec["initContainers"] if c["name"] == "kvferryd"][0]


@pytest.fixture
def tls_files(tmp_path):
    """A CA, a server certificate for localhost signed by it, and a token file."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=kvferry test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=localhost")
    (tmp_path / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "san.ext")
    token_hash = hashlib.sha256(b"worker-token").hexdigest()
    (tmp_path / "tokens").write_text(f"worker {token_hash}\n")
    return tmp_path


def test_sidecar_probes_pass_against_kvferryd_with_the_manifests_arguments(tls_files):
    c = sidecar()
    where = {"/etc/kvferry/tls/": f"{tls_files}/", "/etc/kvferry/tokens/": f"{tls_files}/"}

    def local(text):
        for old, new in where.items():
            text = text.replace(old, new)
        return text
    args = [local(a) for a in c["args"]]
    # The probes' ports are the manifest's; kvferryd here listens on free ones.
    args = [a for a in args if not a.startswith("--metrics_listen=")] + ["--metrics_listen=127.0.0.1:0"]
    daemon, (grpc_port, metrics_port) = start(tls_files, *args)
    try:
        for probe in ("startupProbe", "readinessProbe"):
            command = [local(a).replace("localhost:50051", f"localhost:{grpc_port}")
                       for a in c[probe]["exec"]["command"]]
            command[0] = CLI if command[0] == "kvferry" else command[0]
            r = subprocess.run(command, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, (probe, command, r.stderr)
        # kubelet's HTTPS probes do not verify the certificate.
        liveness = c["livenessProbe"]["httpGet"]
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(f"https://127.0.0.1:{metrics_port}{liveness['path']}",
                                    context=context, timeout=10) as response:
            assert response.status == 200
        # Without the CA the same exec probe fails: TLS is really on.
        r = subprocess.run([CLI, "--target", f"localhost:{grpc_port}", "--timeout", "2", "health"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1
    finally:
        stop(daemon)


def unit_command(key, config, extra_args):
    """The unit's `key=` command line as systemd would run it: $KVFERRYD_ARGS split into
    words, the binary and the config file moved to the built and the example ones."""
    with open(os.path.join(DEPLOY, "kvferryd.service")) as f:
        lines = [l.strip() for l in f if l.startswith(key + "=")]
    assert len(lines) == 1, key
    words = []
    for word in lines[0][len(key) + 1:].split():
        if word == "$KVFERRYD_ARGS":
            words += extra_args
        else:
            words.append(word.replace("/usr/local/bin/kvferryd", DAEMON)
                         .replace("/etc/kvferry/kvferryd.toml", config))
    return words


def test_systemd_unit_commands_check_the_config_then_serve_and_stop_on_sigterm(tmp_path):
    config = os.path.join(DEPLOY, "kvferryd.toml")
    ports = tmp_path / "ports"
    extra = ["--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", f"--port_file={ports}",
             "--default_device=cpu"]
    r = subprocess.run(unit_command("ExecStartPre", config, extra), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("valid"), r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("listen = 50051\n")
    r = subprocess.run(unit_command("ExecStartPre", str(bad), extra), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "bad.toml:1: key 'listen'" in r.stderr
    daemon = subprocess.Popen(unit_command("ExecStart", config, extra), stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (ports.exists() and ports.read_text().strip()):
            assert daemon.poll() is None and time.monotonic() < deadline, "kvferryd did not start"
            time.sleep(0.05)
        grpc_port = int(ports.read_text().split()[0])
        r = subprocess.run([CLI, "--target", f"127.0.0.1:{grpc_port}", "--json", "pool", "list"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        pools = {p["name"]: p for p in json.loads(r.stdout)}   # the example's pool
        assert pools["kv"]["layout"] == "v41" and pools["kv"]["num_layers"] == 2, pools
    finally:
        stop(daemon)
