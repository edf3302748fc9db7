"""Builds the kvferry Python client; the gRPC stubs are generated from ../../proto here.

`pip install ./client/python` works offline: there is deliberately no pyproject.toml, so
pip builds with the setuptools already installed instead of fetching build dependencies
into an isolated environment. The stubs come from protoc with Debian's grpc_python_plugin
(packages protobuf-compiler, protobuf-compiler-grpc), or from grpc_tools when that module
is installed instead.
"""

import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))


def _protos():
    """Every .proto under PROTO_ROOT, relative to it (the import paths protoc sees)."""
    found = []
    for folder, _, files in os.walk(PROTO_ROOT):
        found += [os.path.relpath(os.path.join(folder, f), PROTO_ROOT)
                  for f in files if f.endswith(".proto")]
    if not found:
        raise SystemExit(f"kvferry: no .proto files under {PROTO_ROOT}; build from a kvferry "
                         "checkout (client/python beside proto/)")
    return sorted(found)


def _protoc_command():
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        return [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"]
    try:
        import grpc_tools  # noqa: F401  (pip's grpcio-tools bundles protoc and the plugin)
    except ImportError:
        raise SystemExit("kvferry: generating the stubs needs protoc and grpc_python_plugin "
                         "(Debian: protobuf-compiler protobuf-compiler-grpc) or grpcio-tools")
    return [sys.executable, "-m", "grpc_tools.protoc"]


def generate_stubs(out_dir):
    """Writes <name>_pb2.py and <name>_pb2_grpc.py for every proto into out_dir, plus an
    __init__.py in every generated package folder that lacks one."""
    protos = _protos()
    subprocess.run(_protoc_command() + [
        f"--proto_path={PROTO_ROOT}", f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}"] + protos, check=True)
    for proto in protos:
        folder = os.path.join(out_dir, os.path.dirname(proto))
        while os.path.relpath(folder, out_dir) != ".":
            init = os.path.join(folder, "__init__.py")
            if not os.path.exists(init):
                open(init, "w").close()
            folder = os.path.dirname(folder)


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        if not self.dry_run:
            generate_stubs(self.build_lib)


setup(
    name="kvferry",
    version="0.1.0",
    description="Python client of kvferryd, the DeepSeek-V4 KV-cache sidecar",
    package_dir={"": "src"},
    packages=find_packages("src"),
    python_requires=">=3.9",
    install_requires=["grpcio>=1.51", "protobuf>=4.21", "numpy>=1.22"],
    extras_require={"verify": ["xxhash>=3"], "torch": ["torch"]},
    cmdclass={"build_py": BuildPyWithStubs},
)
