"""The container recipe's pieces that can be checked without a container engine: the
entrypoint's refusals (run against a fake kvferryd that answers --check-config with the
real kvferryd and records what it would have served with), the scripts' syntax and lint,
every path the Containerfile copies from the build context, and the runtime package list.

Environment (set by CMake): KVFERRY_DEPLOY_DIR, KVFERRY_DAEMON, KVFERRY_CLI.
"""
import os
import re
import shutil
import subprocess

import pytest

DEPLOY = os.environ.get("KVFERRY_DEPLOY_DIR", "")
DAEMON = os.environ.get("KVFERRY_DAEMON", "")
CLI = os.environ.get("KVFERRY_CLI", "")
ROOT = os.path.dirname(DEPLOY)
ENTRYPOINT = os.path.join(DEPLOY, "container", "entrypoint.sh")
SCRIPTS = [ENTRYPOINT, os.path.join(DEPLOY, "container", "runtime-packages.sh"),
           os.path.join(DEPLOY, "install-deps.sh"), os.path.join(DEPLOY, "ucx.sh")]


TLS = ["--tls_cert=/etc/kvferry/tls/server.pem", "--tls_key=/etc/kvferry/tls/server.key"]


def test_loopback_starts_with_the_config_file(fake):
    r = fake(config='listen = "127.0.0.1:50051"\n', )
    assert r.returncode == 0, r.stderr
    assert len(r.served) == 1 and r.served[0].startswith("--config=")


def test_arguments_reach_kvferryd_unchanged(fake):
    r = fake("--listen=[::1]:7000", "--metrics_listen", "")
    assert r.returncode == 0, r.stderr
    assert r.served == ["--listen=[::1]:7000", "--metrics_listen", ""]


@pytest.mark.parametrize("listen", ["0.0.0.0:50051", "[::]:50051", "10.1.2.3:50051",
                                    "kvferry.example:50051", "127.evil.example:1"])
def test_remote_grpc_without_tls_is_refused(fake, listen):
    r = fake(f"--listen={listen}")
    assert r.returncode == 78 and r.served is None
    assert f"listen={listen} is beyond loopback without TLS" in r.stderr


def test_remote_grpc_with_tls_but_no_client_authentication_is_refused(fake):
    r = fake("--listen=0.0.0.0:50051", *TLS)
    assert r.returncode == 78 and r.served is None
    assert "clients do not authenticate" in r.stderr


@pytest.mark.parametrize("auth", ["--auth_tokens=/etc/kvferry/tokens/tokens",
                                  "--tls_client_ca=/etc/kvferry/tls/ca.pem"])
def test_remote_grpc_with_tls_and_authentication_starts(fake, auth):
    r = fake("--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9464", *TLS, auth)
    assert r.returncode == 0, r.stderr
    assert "--listen=0.0.0.0:50051" in r.served


def test_remote_metrics_without_tls_is_refused(fake):
    r = fake("--metrics_listen=0.0.0.0:9464")
    assert r.returncode == 78 and r.served is None
    assert "metrics_listen=0.0.0.0:9464 is beyond loopback without TLS" in r.stderr


def test_remote_metrics_with_tls_starts_without_tokens(fake):
    r = fake("--metrics_listen=0.0.0.0:9464", *TLS)
    assert r.returncode == 0, r.stderr


def test_allow_insecure_remote_is_refused(fake):
    r = fake("--allow_insecure_remote")
    assert r.returncode == 78 and "allow_insecure_remote" in r.stderr


def test_the_config_files_listen_counts(fake):
    r = fake(config='listen = "0.0.0.0:50051"\n')
    assert r.returncode == 78 and "beyond loopback without TLS" in r.stderr
    # ... and a flag overrides it, as it does for kvferryd.
    r = fake("--listen=127.0.0.1:50051", config='listen = "0.0.0.0:50051"\n')
    assert r.returncode == 0, r.stderr


def test_a_bad_config_stops_with_kvferryds_message(fake):
    r = fake(config="listen = 50051\n")
    assert r.returncode == 2 and r.served is None
    assert "key 'listen': expected a string, got an integer" in r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_syntax_and_lint(script):
    subprocess.run(["bash", "-n", script], check=True)
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed (deploy/install-deps.sh installs it)"
    r = subprocess.run([shellcheck, script], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def containerfile_copies():
    """(line, sources) of each COPY from the build context (not --from a stage)."""
    out = []
    with open(os.path.join(DEPLOY, "Containerfile")) as f:
        text = f.read().replace("\\\n", " ")
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith("--from") for w in words):
            continue
        sources = [w for w in words[1:-1] if not w.startswith("--")]
        out.append((line, sources))
    return out


def test_containerfile_copies_only_paths_that_exist_and_are_not_ignored():
    copies = containerfile_copies()
    assert copies
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        ignored = [l.strip() for l in f if l.strip() and not l.startswith("#")]
    for line, sources in copies:
        for source in sources:
            assert os.path.exists(os.path.join(ROOT, source)), f"{line}: {source} does not exist"
            top = source.split("/")[0]
            assert not any(re.fullmatch(p.replace("*", ".*"), top) for p in ignored) or source == ".", \
                f"{line}: {source} is excluded by .dockerignore"


def test_containerfile_runs_as_a_user_and_checks_health():
    with open(os.path.join(DEPLOY, "Containerfile")) as f:
        text = f.read()
    final_stage = text[text.rindex("\nFROM "):]
    user = re.search(r"^USER (\S+)", final_stage, re.M)
    assert user and not user.group(1).startswith(("root", "0")), "the runtime stage runs as root"
    assert re.search(r"^HEALTHCHECK .*kvferry .*health", final_stage, re.M | re.S)
    assert 'ENTRYPOINT ["/usr/local/bin/kvferryd-entrypoint"]' in final_stage


def test_runtime_packages_cover_the_built_binaries():
    r = subprocess.run(["bash", os.path.join(DEPLOY, "container", "runtime-packages.sh"),
                        DAEMON, CLI], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    packages = r.stdout.split()
    assert any(p.startswith("libgrpc++") for p in packages), packages
    assert any(p.startswith("libtomlplusplus") for p in packages), packages
    for p in packages:
        status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True,
                                text=True)
        assert "install ok installed" in status.stdout, p
