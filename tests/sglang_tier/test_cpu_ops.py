"""Our CPU stand-ins for SGLang's device<->host copy ops write the page layout SGLang's host pools
define, not just a layout they can read back: a round trip alone would pass an op that scrambles
pages the same way in both directions, and the scrambled bytes would then be what L3 holds.

Each check drives SGLang's own host pool code (which calls the op by name) and compares what lands
in the host pool with the device bytes arranged the way the pool's ``get_page_buffer_meta``
describes a stored page.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Deployment, Engine

import cpu_ops


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (random bytes read as bf16 hold NaNs, which never compare equal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_bytes(ptr: int, size: int) -> bytes:
    return ctypes.string_at(ptr, size)


@pytest.fixture
def kv_split_engine(tmp_path: Path):
    engine = Engine(Deployment("memory", {"store": f"ops-{tmp_path.name}"}, layout="page_first_kv_split", mla=True, dsa=True))
    yield engine
    engine.close()


def randomize(buffers: list[torch.Tensor], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for buffer in buffers:
        flat = buffer.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))


def test_dim_exchange_writes_the_kv_split_page_layout(kv_split_engine: Any) -> None:
    """Ascend's ``transfer_kv_dim_exchange`` (page_first_kv_split): device buffers are layer-major
    ``[layers, pages, page_size, 1, width]`` (SGLang's ``NPUMLATokenToKVPool``), and a stored page
    is, per buffer (K, V, the indexer's K), one run ``[layers, page_size, 1, width]`` at the
    host page's offset (``MLATokenToKVPoolHost.get_page_buffer_meta``)."""
    device = kv_split_engine.allocator.get_kvcache()
    host = kv_split_engine.cache.cache_controller.storage_host_pool
    buffers = [device.k_buffer, device.v_buffer, device.index_k_buffer]
    randomize(buffers, seed=1)
    page_size = host.page_size
    device_pages, host_pages = torch.tensor([5, 2, 7]), torch.tensor([1, 6, 3])
    slots = torch.arange(page_size)

    def token_slots(pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * page_size + slots).reshape(-1)

    # SGLang's host pool calls the op (by its global name, as on Ascend).
    host.backup_from_device_all_layer(device, token_slots(host_pages), token_slots(device_pages), "kernel_ascend")
    ptrs, sizes = host.get_page_buffer_meta(token_slots(host_pages))
    assert len(ptrs) == 3 * len(host_pages)
    for i, device_page in enumerate(device_pages.tolist()):
        for j, buffer in enumerate(buffers):
            expected = buffer[:, device_page].contiguous().view(torch.uint8).numpy().tobytes()
            assert run_bytes(ptrs[3 * i + j], sizes[3 * i + j]) == expected, f"page {i}, buffer {j}"

    # And back: the host pages land in other device pages, layer by layer, bit for bit.
    before = [buffer.clone() for buffer in buffers]
    targets = torch.tensor([9, 10, 11])
    host.load_to_device_per_layer(device, token_slots(host_pages), token_slots(targets), 0, "kernel_ascend")
    for buffer, original in zip(buffers, before):
        assert same(buffer[:, targets], original[:, device_pages])
        untouched = torch.ones(buffer.shape[1], dtype=torch.bool)
        untouched[targets] = False
        assert same(buffer[:, untouched], original[:, untouched])


def test_dim_exchange_moves_whole_pages_only() -> None:
    """The op copies whole pages; token slots that are not a page's run are refused, not half-copied."""
    device, host = torch.zeros(2, 4, 4, 1, 3), torch.zeros(4, 2, 4, 1, 3)
    with pytest.raises(ValueError, match="whole pages"):
        cpu_ops.transfer_kv_dim_exchange(
            device_indices=torch.tensor([1, 2, 3, 4]), host_indices=torch.arange(4), device_k=device, host_k=host,
            device_v=None, host_v=None, page_size=4, direction=cpu_ops.TransferDirection.D2H,
        )  # fmt: skip


MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def host_page_of(layout: str, mla: bool, rows: torch.Tensor) -> torch.Tensor:
    """A host page as SGLang's host pool buffers hold it (``init_kv_buffer`` of pool_host/mha.py and
    mla.py; ``get_data_page(flat=False)`` is a view of it), from its rows ``[(2,) layers,
    page_size, heads, dim]`` in layer-first order."""
    if mla:
        return {"layer_first": rows, "page_first": rows.transpose(0, 1), "page_first_direct": rows.unsqueeze(0)}[layout]
    return {
        "layer_first": rows,  # (2, layers, tokens, heads, dim)
        "page_first": rows.transpose(1, 2),  # (2, tokens, layers, heads, dim)
        "page_first_direct": rows.unsqueeze(1),  # (2, pages, layers, page_size, heads, dim)
        "page_head": rows.permute(0, 3, 2, 1, 4).unsqueeze(1),  # (2, pages, heads, page_size, layers, dim)
    }[layout]


@pytest.mark.parametrize(
    "mla,layout", [(False, layout) for layout in MHA_LAYOUTS] + [(True, layout) for layout in MLA_LAYOUTS],
    ids=[f"mha-{layout}" for layout in MHA_LAYOUTS] + [f"mla-{layout}" for layout in MLA_LAYOUTS],
)  # fmt: skip
def test_copy_ops_write_the_host_page_layout(tmp_path: Path, mla: bool, layout: str) -> None:
    """The MHA / MLA copy ops (kernel and direct backends): device token rows scattered over the
    device pool land in whole host pages in the pool's layout, and load back to other device
    rows bit for bit, layer by layer."""
    engine = Engine(Deployment("memory", {"store": f"ops-{tmp_path.name}"}, layout=layout, mla=mla))
    try:
        device = engine.allocator.get_kvcache()
        host = engine.cache.cache_controller.storage_host_pool
        io_backend = engine.deployment.io_backend
        layers = [*device.k_buffer, *device.v_buffer] if not mla else list(device.kv_buffer)
        randomize(layers, seed=2)
        page_size = host.page_size
        generator = torch.Generator().manual_seed(3)
        device_slots = (torch.randperm(200, generator=generator)[: 2 * page_size] + 1).long()
        host_pages = torch.tensor([3, 1])
        host_slots = (host_pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        host.backup_from_device_all_layer(device, host_slots, device_slots, io_backend)
        for p, page in enumerate(host_pages.tolist()):
            slots = device_slots[p * page_size : (p + 1) * page_size]
            if mla:
                rows = torch.stack([layer[slots] for layer in device.kv_buffer])
            else:
                rows = torch.stack([torch.stack([layer[slots] for layer in half]) for half in (device.k_buffer, device.v_buffer)])
            assert same(host.get_data_page(page * page_size, flat=False), host_page_of(layout, mla, rows)), f"host page {page}"
        before = [layer.clone() for layer in layers]
        targets = torch.arange(300, 300 + 2 * page_size)
        for layer_id in range(len(layers) // (1 if mla else 2)):
            host.load_to_device_per_layer(device, host_slots, targets, layer_id, io_backend)
        for layer, original in zip(layers, before):
            assert same(layer[targets], original[device_slots])
    finally:
        engine.close()
