"""Tokens through the Python client: a daemon with --auth_tokens serves only callers that
send a valid bearer token, and each tenant sees only its own pools."""
import hashlib

import grpc
import pytest

import kvferry

from conftest import Daemon, device, expect_reason


@pytest.fixture
def secured(tmp_path):
    tokens = {"alice": "alice-secret-1", "bob": "bob-secret-2"}
    path = tmp_path / "tokens"
    path.write_text("".join(f"{tenant} {hashlib.sha256(token.encode()).hexdigest()}\n"
                            for tenant, token in tokens.items()))
    d = Daemon(f"--auth_tokens={path}")
    yield d, tokens
    d.stop()


def test_calls_without_a_valid_token_are_unauthenticated(secured):
    d, tokens = secured
    for token in (None, "wrong"):
        with kvferry.Client(d.address, token=token) as c:
            with pytest.raises(kvferry.Error) as info:
                c.list_pools()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            expect_reason(info.value, "NOT_AUTHENTICATED")


def test_a_tenant_sees_only_its_own_pools(secured):
    d, tokens = secured
    with kvferry.Client(d.address, token=tokens["alice"]) as alice, \
            kvferry.Client(d.address, token=tokens["bob"]) as bob:
        alice.create_pool("mine", layout=kvferry.Layout.V41, page_size=16, num_pages=4, device=device())
        assert [p.name for p in alice.list_pools()] == ["mine"]
        assert bob.list_pools() == []
        with pytest.raises(kvferry.Error) as info:
            bob.describe_pool("mine")
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        expect_reason(info.value, "POOL_NOT_FOUND")
