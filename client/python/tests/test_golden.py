"""Golden vectors through kvferryd and the client, byte for byte: rows -> pages, the
workspace, transcodes to V4, and pages written back with write_pages."""

import numpy as np
import pytest

import kvferry
from conftest import LAYOUTS, device, golden_cases

CASES = golden_cases()


def sorted_pages(pages: kvferry.Pages) -> kvferry.Pages:
    return pages[np.argsort(pages.ids)]


# 8 KiB chunks split every write into messages of a few rows and every read into many
# chunks (a golden page is 4.6-150 KB), so reassembly and offsets are exercised.
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 8192], ids=["1MiB", "8KiB"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_round_trip_is_byte_exact(daemon, case, layout, chunk_bytes):
    client = kvferry.Client(daemon.address, chunk_bytes=chunk_bytes, verify_checksums=True)
    pool = client.create_pool("g", LAYOUTS[layout], case.page_size, case.num_pages,
                              device=device())
    assert pool.page_bytes == case.layouts[layout]["page_bytes"]
    pages = sorted_pages(client.allocate_pages("g", case.num_pages))
    assert pages.ids.tolist() == list(range(case.num_pages))

    written = client.write_tokens("g", 0, case.rows, case.locs, pages)
    assert written.tokens_written == len(case.locs)

    assert client.read_pages("g", pages).tobytes() == case.bytes(f"pool.{layout}.bin")
    workspace = client.read_workspace("g", 0, case.locs, pages)
    assert workspace.dtype == np.uint16 and workspace.shape == case.rows.shape
    assert np.array_equal(workspace, case.array(f"dequant.{layout}.bf16"))
    transcoded = client.read_pages("g", pages, transcode_to=kvferry.Layout.V4)
    assert transcoded.tobytes() == case.bytes(f"transcode.{layout}_to_v4.bin")

    # The raw pages written into a second pool come back identical.
    client.create_pool("copy", LAYOUTS[layout], case.page_size, case.num_pages, device=device())
    copy_pages = sorted_pages(client.allocate_pages("copy", case.num_pages))
    copied = client.write_pages("copy", LAYOUTS[layout], copy_pages,
                                case.bytes(f"pool.{layout}.bin"), layers=[0])
    assert copied.pages_written == case.num_pages
    assert client.read_pages("copy", copy_pages).tobytes() == case.bytes(f"pool.{layout}.bin")

    stats = {p.name: p for p in client.get_stats().pools}["g"]
    effective = case.layouts[layout]["page_bytes"] / case.page_size
    assert stats.tokens_held == len(case.locs)
    assert stats.nominal_bytes_per_token == case.layouts[layout]["bytes_per_token"]
    assert stats.effective_bytes_per_token == effective
    assert stats.bytes_saved_vs_bf16 == len(case.locs) * (1024 - effective)
    client.close()


def test_reads_land_in_caller_buffers(client):
    case = CASES[0]
    client.create_pool("g", kvferry.Layout.V41, case.page_size, case.num_pages, device=device())
    pages = sorted_pages(client.allocate_pages("g", case.num_pages))
    client.write_tokens("g", 0, case.rows, case.locs, pages)

    rows = np.full(case.rows.shape, 0xFFFF, dtype=np.uint16)
    view = client.read_workspace("g", 0, case.locs, pages, out=rows)
    assert np.shares_memory(view, rows)
    assert np.array_equal(rows, case.array("dequant.v41.bf16"))

    raw = bytearray(len(case.bytes("pool.v41.bin")) + 100)
    view = client.read_pages("g", pages, out=raw)
    assert view.size == len(raw) - 100
    assert bytes(raw[:view.size]) == case.bytes("pool.v41.bin")

    with pytest.raises(kvferry.Error) as error:
        client.read_pages("g", pages, out=bytearray(100))
    assert error.value.code.name == "INVALID_ARGUMENT"


def test_layers_select_and_order_pages(client):
    client.create_pool("l", kvferry.Layout.V4, 16, 4, num_layers=3, device=device())
    pages = client.allocate_pages("l", 2)
    locs = np.concatenate([pages.ids[0] * 16 + np.arange(16), pages.ids[1] * 16 + np.arange(4)])
    locs = locs.astype(np.int64)
    for layer in range(3):
        client.write_tokens("l", layer, np.roll(np.arange(20 * 512, dtype=np.uint16) % 8000,
                                                layer).reshape(20, 512), locs, pages)
    everything = client.read_pages("l", pages)  # layers=None: every layer, size unknown
    page_bytes = client.describe_pool("l").page_bytes
    assert everything.size == 2 * 3 * page_bytes
    per_layer = everything.reshape(2, 3, page_bytes)
    picked = client.read_pages("l", pages, layers=[2, 0])
    assert np.array_equal(picked.reshape(2, 2, page_bytes), per_layer[:, [2, 0]])
    # write_pages with layers=None takes the same order back.
    client.create_pool("l2", kvferry.Layout.V4, 16, 4, num_layers=3, device=device())
    other = client.allocate_pages("l2", 2)
    client.write_pages("l2", kvferry.Layout.V4, other, everything)
    assert np.array_equal(client.read_pages("l2", other), everything)
    workspace = client.read_workspace("l", 1, locs[::-1], pages)
    assert np.array_equal(workspace, client.read_workspace("l", 1, locs, pages)[::-1])


def test_torch_cpu_tensors_in_and_out(client):
    torch = pytest.importorskip("torch")
    case = CASES[1]
    client.create_pool("t", kvferry.Layout.V4, case.page_size, case.num_pages, device=device())
    pages = sorted_pages(client.allocate_pages("t", case.num_pages))
    rows = kvferry.torch_bf16(case.rows)
    assert rows.dtype == torch.bfloat16 and np.shares_memory(rows.view(torch.int16).numpy(), case.rows)
    client.write_tokens("t", 0, rows, torch.from_numpy(case.locs), pages)
    out = torch.empty(rows.shape, dtype=torch.bfloat16)
    client.read_workspace("t", 0, torch.from_numpy(case.locs), pages, out=out)
    assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), case.array("dequant.v4.bf16"))
    pool_bytes = torch.empty(len(case.bytes("pool.v4.bin")), dtype=torch.uint8)
    client.read_pages("t", pages, out=pool_bytes)
    assert pool_bytes.numpy().tobytes() == case.bytes("pool.v4.bin")


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_push_and_pull_between_daemons_are_byte_exact(daemon, client, layout):
    # Another daemon beside the fixture's; pages move between the two over UCX.
    from conftest import Daemon
    other = Daemon()
    try:
        case = CASES[0]
        src = "src"
        client.create_pool(src, LAYOUTS[layout], case.page_size, case.num_pages, device=device())
        pages = sorted_pages(client.allocate_pages(src, case.num_pages))
        client.write_tokens(src, 0, case.rows, case.locs, pages)
        with kvferry.Client(other.address) as peer:
            peer.create_pool("dst", LAYOUTS[layout], case.page_size, case.num_pages,
                             device=device())
            peer.create_pool("v4", kvferry.Layout.V4, case.page_size, case.num_pages,
                             device=device())
            dst = sorted_pages(peer.allocate_pages("dst", case.num_pages))
            v4 = sorted_pages(peer.allocate_pages("v4", case.num_pages))
            done = client.push(src, pages, other.address, "dst", dst)
            assert done.pages == case.num_pages
            assert peer.read_pages("dst", dst).tobytes() == case.bytes(f"pool.{layout}.bin")
            # Pulled by the other daemon, transcoded to V4 on the way.
            peer.pull(daemon.address, src, pages, "v4", v4, transcode_to=kvferry.Layout.V4)
            assert peer.read_pages("v4", v4).tobytes() == case.bytes(f"transcode.{layout}_to_v4.bin")
            # Another layout without transcoding is refused with its reason.
            if layout != "v4":
                with pytest.raises(kvferry.Error) as refused:
                    client.push(src, pages, other.address, "v4", v4)
                assert refused.value.reason == "LAYOUT_MISMATCH", refused.value
    finally:
        other.stop()
