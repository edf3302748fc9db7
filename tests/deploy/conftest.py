"""Shared by the deploy tests: the container entrypoint run against a fake kvferryd."""
import os
import subprocess

import pytest

DEPLOY = os.environ.get("KVFERRY_DEPLOY_DIR", "")
DAEMON = os.environ.get("KVFERRY_DAEMON", "")
ENTRYPOINT = os.path.join(DEPLOY, "container", "entrypoint.sh")


@pytest.fixture
def fake(tmp_path):
    """A kvferryd that checks configs with the real one and otherwise records its args."""
    served = tmp_path / "served"
    script = tmp_path / "kvferryd"
    script.write_text(
        "#!/usr/bin/env bash\n"
        "for a in \"$@\"; do case $a in --check-config*|--check_config*) "
        f"exec {DAEMON} \"$@\";; esac; done\n"
        f"printf '%s\\n' \"$@\" > {served}\n")
    script.chmod(0o755)

    def run(*args, config=None):
        """Runs the entrypoint with `args` and, unless None, `config` as the config file's
        text. The result has .served: kvferryd's arguments, None when it was not run."""
        env = dict(os.environ, KVFERRYD=str(script))
        if config is not None:
            path = tmp_path / "kvferryd.toml"
            path.write_text(config)
            env["KVFERRY_CONFIG"] = str(path)
        else:
            env["KVFERRY_CONFIG"] = ""
        if served.exists():
            served.unlink()
        result = subprocess.run(["bash", ENTRYPOINT, *args], env=env, capture_output=True,
                                text=True, timeout=30)
        result.served = served.read_text().splitlines() if served.exists() else None
        return result
    return run


