"""HostKVCache: the L2 pool contract shared by every pool kind.

A host pool mirrors one device pool component by component. Each component lives in its own
page-aligned buffer whose shape the layout decides (``layout.py``); the IO routine for the
(kind, layout, io_backend) cell comes from ``kvcacheio/dispatch.py`` at construction.

Index arguments are token slots (request slots for state pools): 1-D int tensors, whole pages,
host slots in [0, size), device slots in [0, device_pool.total_slots). A page is named by its
first slot. Every bad index raises ValueError before any byte moves.
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.mem_cache.allocator import PagedAllocator
from sglang.srt.mem_cache.kvcacheio.dispatch import IORoutine, default_io_backend, resolve_io
from sglang.srt.mem_cache.kvcacheio.spec import ComponentIO
from sglang.srt.mem_cache.memory_pool.base import KVCache, KVComponent, PoolKind, storage_dtype
from sglang.srt.mem_cache.pool_host.layout import (
    HostLayout,
    IOBackend,
    device_item_map,
    host_item_map,
    host_shape,
    num_chunks,
)
from sglang.srt.mem_cache.pool_host.memory import HostBuffer, check_host_memory
from sglang.srt.mem_cache.utils import as_cpu_index, check_in_range, check_page_aligned

logger = logging.getLogger(__name__)



def pins_by_default(device_pool_device) -> bool:
    """Pinned host memory only serves copies to and from a CUDA device."""
    return torch.device(device_pool_device).type == "cuda"

class HostKVCache:
    """Host mirror of a device pool.

    Upstream's keywords: sized by ``host_size`` (GB of host memory, when > 0) or else
    ``host_to_device_ratio`` times the device pool size, or exactly ``size`` slots when given
    (side pools take their anchor's size); the size is rounded down to whole pages.
    ``pin_memory`` None pins when the device pool is on a CUDA device (a CPU pool on a CUDA host
    pins nothing and makes no CUDA context); ``device`` is where the host buffers live
    (``cpu``); ``io_backend`` None picks ``kernel`` on CUDA, ``direct`` elsewhere.

    ``kv_buffer`` holds the component buffers as the pool kind shapes them (``init_kv_buffer``);
    a new ``kv_buffer`` takes effect at the next copy.
    """

    kind: PoolKind
    can_use_write_back_jit = False  # staged device -> host backups (the asymmetric MHA pool has them)
    _last_checked = None  # (host indices, device indices, device pool, their versions): see _check_transfer
    _io_specs_for = None  # the kv_buffer the cached IO specs (_io_specs) were built from
    _io_specs: dict[str, ComponentIO] = {}

    def __init__(
        self,
        device_pool: KVCache,
        host_to_device_ratio: float = 2.0,
        host_size: float = 0.0,
        page_size: int | None = None,
        layout: str | HostLayout = HostLayout.LAYER_FIRST,
        pin_memory: bool | None = None,
        device: str = "cpu",
        allocator_type: str = "default",
        *,
        io_backend: str | IOBackend | None = None,
        size: int | None = None,
    ):
        if device_pool.kind is not self.kind:
            raise TypeError(f"{type(self).__name__} mirrors a {self.kind.value} pool, got {type(device_pool).__name__}")
        self.device_pool = device_pool
        page_size = device_pool.page_size if page_size is None else page_size
        if page_size != device_pool.page_size:
            raise ValueError(f"page_size {page_size} differs from the device pool's {device_pool.page_size}")
        self.page_size = page_size
        self.layer_num = device_pool.layer_num
        self.start_layer, self.end_layer = device_pool.start_layer, device_pool.end_layer
        self.components = device_pool.components
        self.size_per_token = device_pool.get_size_per_token()
        self.dtype = device_pool.dtype
        size = self._resolve_size(host_to_device_ratio, host_size, size)
        io_backend = default_io_backend(device_pool.device) if io_backend is None else io_backend
        if pin_memory is None:
            pin_memory = pins_by_default(device_pool.device)
        self._setup(size, layout, io_backend, pin_memory, device, allocator_type)

    def _setup(self, size: int, layout, io_backend, pin_memory, device, allocator_type) -> None:
        """Everything after the geometry (page_size, layer_num, components, size_per_token, dtype):
        the IO cell, the buffers and the slot allocator."""
        if str(device) != "cpu":
            raise ValueError(f"host pools live in host memory: device must be 'cpu', got {device!r}")
        if allocator_type != "default":
            raise ValueError(f"allocator_type must be 'default' (page-aligned mmap), got {allocator_type!r}")
        self.device = "cpu"
        self.layout = HostLayout.parse(layout)
        self.io_backend = IOBackend.parse(io_backend)
        self.io: IORoutine = resolve_io(self.kind, self.layout, self.io_backend)
        self.size = size
        self.page_num = self.size // self.page_size
        self.pin_memory = bool(pin_memory)
        check_host_memory(self.size * self.size_per_token, f"{type(self).__name__} ({self.size} slots)")
        self._host_memory: list[HostBuffer] = []
        self.kv_buffer = self.init_kv_buffer()
        self.allocator = PagedAllocator(self.page_num, self.page_size)
        logger.info(
            "%s: %d slots (%d pages), %.3f GB, layout=%s, io_backend=%s",
            type(self).__name__,
            self.size,
            self.page_num,
            self.size * self.size_per_token / 1e9,
            self.layout.value,
            self.io_backend.value,
        )

    # ---- sizing and buffers -------------------------------------------------------------
    def _resolve_size(self, ratio: float, size_gb: float, size: int | None) -> int:
        P = self.page_size
        if size is not None:
            slots = int(size)
        elif size_gb and size_gb > 0:
            if self.size_per_token == 0:
                raise ValueError(f"{type(self).__name__} holds no bytes and cannot be sized in GB; give a ratio or size")
            slots = int(size_gb * 1e9) // self.size_per_token
        else:
            if ratio <= 0:
                raise ValueError(f"host_to_device_ratio must be > 0 when host_size is 0, got {ratio}")
            slots = int(self.device_pool.size * ratio)
            if ratio <= 1:
                logger.warning("host pool (ratio %.2f) is not larger than the device pool", ratio)
        slots = slots // P * P
        if slots < P:
            raise ValueError(f"host pool would hold {slots} slots, less than one page of {P}; raise its size")
        return slots

    def init_kv_buffer(self):
        """Allocate every component's buffer (page-aligned host memory, shaped by the layout) and
        return them: one tensor for a one-component pool, else a tuple in component order."""
        tensors = []
        for comp in self.components:
            shape = host_shape(self.layout, self.size, self.layer_num, self.page_size, comp.item_shape)
            buf = HostBuffer(self.size * self.layer_num * comp.item_bytes, self.pin_memory)
            self._host_memory.append(buf)
            tensors.append(buf.tensor.view(storage_dtype(comp.dtype)).view(shape))
        if not tensors:
            return None
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def _component_buffers(self) -> list[torch.Tensor]:
        """The typed host tensor of every component, in component order (from ``kv_buffer``)."""
        buffers = self.kv_buffer
        if buffers is None:
            return []
        return list(buffers) if isinstance(buffers, (tuple, list)) else [buffers]

    def _component_io(self, comp: KVComponent, host: torch.Tensor, device_pool: KVCache) -> ComponentIO:
        chunks = num_chunks(self.layout, comp.item_shape)
        return ComponentIO(
            host=host,
            device=device_pool.buffers[comp.name],
            host_map=host_item_map(self.layout, self.size, self.layer_num, self.page_size, comp.item_shape),
            device_map=device_item_map(device_pool.total_slots, self.page_size, comp.item_shape, chunks),
            layout=self.layout,
            page_size=self.page_size,
        )

    def host_buffer(self, name: str) -> torch.Tensor:
        """Typed host tensor of component ``name``, shaped by the layout."""
        for comp, buf in zip(self.components, self._component_buffers()):
            if comp.name == name:
                return buf
        raise KeyError(f"{type(self).__name__} has no component {name!r}; has {[c.name for c in self.components]}")

    def get_size_per_token(self) -> int:
        return self.size_per_token

    @property
    def page_format(self) -> str:
        """Identifies the byte format of a flat page (kind, layout order, component geometry)."""
        comps = ",".join(f"{c.name}:{str(c.dtype).removeprefix('torch.')}:{'x'.join(map(str, c.item_shape))}" for c in self.components)
        return f"{self.kind.value}/{self.layout.page_format}/L{self.layer_num}/P{self.page_size}/{comps}"

    # ---- slot allocation ----------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate ``need_size`` slots (a page multiple); None when the pool is full."""
        return self.allocator.alloc(need_size)

    def free(self, indices, trusted: bool = False) -> int:
        """Free whole pages of slots; ValueError on partial pages or a double free. Returns count.
        ``trusted``: see ``PagedAllocator.free``."""
        idx = as_cpu_index(indices, "host indices")
        self.allocator.free(idx, trusted=trusted)
        return idx.numel()

    def available_size(self) -> int:
        return self.allocator.available_size()

    def clear(self) -> None:
        self.allocator.clear()

    # ---- validation ---------------------------------------------------------------------
    def _check_device_pool(self, device_pool: KVCache) -> None:
        mine = [(c.name, c.dtype, c.item_shape) for c in self.components]
        theirs = [(c.name, c.dtype, c.item_shape) for c in device_pool.components]
        if device_pool.kind is not self.kind or mine != theirs or device_pool.layer_num != self.layer_num:
            raise ValueError(
                f"device pool does not match this host pool: host {self.kind.value} {mine} x {self.layer_num} layers, "
                f"device {device_pool.kind.value} {theirs} x {device_pool.layer_num} layers"
            )
        if device_pool.page_size != self.page_size:
            raise ValueError(f"device page_size {device_pool.page_size} != host page_size {self.page_size}")

    def _check_transfer(self, device_pool: KVCache, host_indices, device_indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated CPU int64 views of both index lists. A load checks the same two tensors once
        per layer: the last pair checked is remembered (with torch's in-place version counters,
        so a tensor modified in place since is checked again; only tensors used as they are, never
        converted copies), and only the first layer pays (~20 us of Python under the GIL each,
        issue 9)."""
        last = self._last_checked
        if (last is not None and last[0] is host_indices and last[1] is device_indices and last[2] is device_pool
                and last[3] == host_indices._version and last[4] == device_indices._version):
            return host_indices, device_indices
        host_idx, dev_idx = self._check_transfer_uncached(device_pool, host_indices, device_indices)
        if host_idx is host_indices and dev_idx is device_indices:  # already CPU int64: nothing converted
            # one tuple, swapped atomically (the write and load lanes share the pool)
            self._last_checked = (host_indices, device_indices, device_pool, host_indices._version,
                                  device_indices._version)
        return host_idx, dev_idx

    def _check_transfer_uncached(self, device_pool: KVCache, host_indices, device_indices):
        self._check_device_pool(device_pool)
        host_idx = as_cpu_index(host_indices, "host indices")
        dev_idx = as_cpu_index(device_indices, "device indices")
        if host_idx.numel() != dev_idx.numel():
            raise ValueError(f"host indices ({host_idx.numel()}) and device indices ({dev_idx.numel()}) differ in length")
        check_page_aligned(host_idx, self.page_size, "host indices")
        check_page_aligned(dev_idx, self.page_size, "device indices")
        check_in_range(host_idx, 0, self.size, "host indices")
        check_in_range(dev_idx, 0, device_pool.total_slots, "device indices")
        return host_idx, dev_idx

    def _specs_for(self, device_pool: KVCache) -> dict[str, ComponentIO]:
        """Component name -> what its copy routine is given, for this pair (cached for the pool's
        own device pool until ``kv_buffer`` is replaced)."""
        buffers = self.kv_buffer
        if device_pool is self.device_pool and self._io_specs_for is buffers:
            return self._io_specs
        specs = {c.name: self._component_io(c, h, device_pool) for c, h in zip(self.components, self._component_buffers())}
        if device_pool is self.device_pool:
            self._io_specs, self._io_specs_for = specs, buffers
        return specs

    def _resolve(self, io_backend) -> IORoutine:
        if io_backend is None or IOBackend.parse(io_backend) is self.io_backend:
            return self.io
        return resolve_io(self.kind, self.layout, IOBackend.parse(io_backend))

    # ---- device <-> host ----------------------------------------------------------------
    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id: int, io_backend=None) -> None:
        """Copy layer ``layer_id`` (pool-local, in [0, layer_num)) of the named pages host -> device.

        Mutates only ``device_pool``'s slots ``device_indices`` of that layer.
        """
        routine = self._resolve(io_backend)
        host_idx, dev_idx = self._check_transfer(device_pool, host_indices, device_indices)
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id {layer_id} outside [0, {self.layer_num})")
        for spec in self._specs_for(device_pool).values():
            routine.load_per_layer(spec, host_idx, dev_idx, layer_id)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend=None) -> None:
        """Copy every layer of the named pages device -> host. Mutates only host slots ``host_indices``."""
        routine = self._resolve(io_backend)
        host_idx, dev_idx = self._check_transfer(device_pool, host_indices, device_indices)
        for spec in self._specs_for(device_pool).values():
            routine.backup_all_layer(spec, host_idx, dev_idx)

    # ---- pages for storage --------------------------------------------------------------
    def _check_page_index(self, index: int) -> int:
        index = int(index)
        if index % self.page_size or not 0 <= index < self.size:
            raise ValueError(
                f"page index {index} must be a multiple of page_size {self.page_size} in [0, {self.size})"
            )
        return index

    def _page_chunks(self, index: int) -> list[torch.Tensor]:
        """Byte views of the buffers of the page starting at slot ``index``, in meta order."""
        page = index // self.page_size
        P = self.page_size
        chunks = []
        for data in self._component_buffers():
            if self.layout is HostLayout.LAYER_FIRST:
                chunks.extend(data[layer, index : index + P].view(torch.uint8).reshape(-1) for layer in range(self.layer_num))
            elif self.layout is HostLayout.PAGE_FIRST:
                chunks.append(data[index : index + P].view(torch.uint8).reshape(-1))
            else:
                chunks.append(data[page].view(torch.uint8).reshape(-1))
        return chunks

    @property
    def page_bytes(self) -> int:
        """Bytes of one flat page."""
        return self.size_per_token * self.page_size

    def get_data_page(self, index: int, flat: bool = True):
        """The page starting at host slot ``index``: a uint8 copy of its bytes when ``flat``,
        else the list of its buffer views (no copy), in ``get_page_buffer_meta`` order."""
        chunks = self._page_chunks(self._check_page_index(index))
        if not flat:
            return chunks
        if not chunks:
            return torch.empty(0, dtype=torch.uint8)
        return torch.cat(chunks)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zeroed uint8 tensor the size of one flat page (a read target)."""
        return torch.zeros(self.page_bytes, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a flat page (uint8, ``page_bytes`` long) into the page at host slot ``index``."""
        index = self._check_page_index(index)
        if data_page.dtype != torch.uint8 or data_page.numel() != self.page_bytes:
            raise ValueError(
                f"flat page must be uint8 of {self.page_bytes} bytes, got {data_page.dtype} of {data_page.numel()}"
            )
        data_page = data_page.reshape(-1)
        offset = 0
        for chunk in self._page_chunks(index):
            n = chunk.numel()
            chunk.copy_(data_page[offset : offset + n])
            offset += n

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """(pointers, byte sizes) of every buffer of every page in ``indices``.

        Order: pages in the order given (a page is every ``page_size``-th slot); within a page,
        components in pool order (MHA: K then V; Mamba: temporal, conv_0, ...); within a
        component, one buffer for page-contiguous layouts or one per layer for layer_first.
        The bytes at these pointers, concatenated, are exactly ``get_data_page``.
        """
        idx = as_cpu_index(indices, "host indices")
        check_page_aligned(idx, self.page_size, "host indices")
        check_in_range(idx, 0, self.size, "host indices")
        ptrs, sizes = [], []
        for start in idx[:: self.page_size].tolist():
            for chunk in self._page_chunks(start):
                ptrs.append(chunk.data_ptr())
                sizes.append(chunk.numel())
        return ptrs, sizes

    def buffers_per_page(self) -> int:
        """How many (pointer, size) entries ``get_page_buffer_meta`` yields per page."""
        per_comp = self.layer_num if self.layout is HostLayout.LAYER_FIRST else 1
        return per_comp * len(self.components)

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        """True exactly when every page buffer starts at a multiple of ``page_size_bytes`` and
        consecutive pages of the same buffer are a multiple of ``page_size_bytes`` apart (what
        O_DIRECT on every page pointer needs)."""
        if self.page_num == 0 or not self.components:
            return True
        first, sizes = self.get_page_buffer_meta(torch.arange(self.page_size))
        if any(p % page_size_bytes for p in first):
            return False
        if self.page_num == 1:  # no second page: the stride is the buffer size
            return all(s % page_size_bytes == 0 for s in sizes)
        second, _ = self.get_page_buffer_meta(torch.arange(self.page_size, 2 * self.page_size))
        return all((b - a) % page_size_bytes == 0 for a, b in zip(first, second))

    def get_host_buffers(self) -> list[torch.Tensor]:
        """Every component's bytes as one flat uint8 tensor each (what a zero-copy backend registers)."""
        return [t.view(-1).view(torch.uint8) for t in self._component_buffers()]

    def destroy(self) -> None:
        """Unpin host memory (pinned pages are slow to release at process exit)."""
        for buf in self._host_memory:
            buf.release()
