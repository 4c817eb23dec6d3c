"""Host pools for MHA/GQA and asymmetric MHA: separate K and V buffers.

``kv_buffer`` is the pair ``(k_buffer, v_buffer)``, each in its own page-aligned mapping (upstream
keeps symmetric K and V in one ``(2, ...)`` tensor; indexing ``kv_buffer[0]`` / ``[1]`` reads the
same). The asymmetric pool's ``page_first`` + ``kernel`` and ``page_first_direct`` + ``direct``
cells call the sgl-kernel op names upstream's pool calls (``kvcacheio/ops.py``), K and V apart,
each with its own byte strides; its other cells, and every cell of the symmetric pool, run the IO
table's routines.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.kvcacheio.dispatch import resolve_io
from sglang.srt.mem_cache.kvcacheio.ops import (
    can_use_write_back_jit_kernel,
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_all_layer_mla_lf_pf,
    transfer_kv_per_layer_direct_pf_lf,
    transfer_kv_per_layer_mla_pf_lf,
)
from sglang.srt.mem_cache.kvcacheio.ops import (
    transfer_hicache_all_layer_mla_staged_lf_pf as jit_transfer_hicache_all_layer_mla_staged_lf_pf,
)
from sglang.srt.mem_cache.memory_pool.base import PoolKind, storage_dtype
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend
from sglang.srt.mem_cache.utils import as_cpu_index, check_in_range, check_page_aligned
from sglang.srt.platforms import current_platform

_is_cuda = current_platform.is_cuda()
_is_hip = current_platform.is_rocm()

# Staging for the staged write-back holds at most this many pages (upstream's chunk).
_WRITE_BACK_STAGING_PAGE_CHUNK = 64


class MHATokenToKVPoolHost(HostKVCache):
    """K and V, each (head_num, head_dim) per token per layer; all four layouts."""

    kind = PoolKind.MHA

    def __init__(self, device_pool, *args, **kwargs):
        super().__init__(device_pool, *args, **kwargs)
        self.head_num = device_pool.head_num
        self.head_dim = device_pool.head_dim
        self.v_head_dim = device_pool.v_head_dim

    def init_kv_buffer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate K and V, each in its own page-aligned buffer; returns ``(k, v)``."""
        return super().init_kv_buffer()

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @k_buffer.setter
    def k_buffer(self, value: torch.Tensor) -> None:
        self.kv_buffer = (value, self.kv_buffer[1])

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    @v_buffer.setter
    def v_buffer(self, value: torch.Tensor) -> None:
        self.kv_buffer = (self.kv_buffer[0], value)

    def get_ksize_per_token(self) -> int:
        """Bytes of K per token over all layers."""
        return self.head_num * self.head_dim * self.layer_num * self.dtype.itemsize


class AsymmetricMHATokenToKVPoolHost(MHATokenToKVPoolHost):
    """K (head_num, head_dim) and V (head_num, v_head_dim), head_dim != v_head_dim.

    Layouts ``layer_first``, ``page_first`` and ``page_first_direct`` (each buffer with its own
    dims; ``page_head`` would cut K and V heads of different sizes). Flat pages (L3) work as for
    every pool. The copy methods read the device pool's ``k_buffer`` / ``v_buffer`` lists and
    ``k_data_ptrs`` / ``v_data_ptrs`` address tables, and check them before any byte moves.
    """

    kind = PoolKind.ASYMMETRIC_MHA
    # Cells served by sgl-kernel's op names (upstream's two); the rest go through the IO table.
    _OP_CELLS = ((HostLayout.PAGE_FIRST, IOBackend.KERNEL), (HostLayout.PAGE_FIRST_DIRECT, IOBackend.DIRECT))

    def __init__(self, device_pool, *args, **kwargs):
        super().__init__(device_pool, *args, **kwargs)
        self._init_write_back_staging_buffers()

    def get_ksize_per_token(self) -> int:
        return self._k_token_stride_size() * self.layer_num

    def _k_token_stride_size(self) -> int:
        return self.head_num * self.head_dim * self.dtype.itemsize

    def _v_token_stride_size(self) -> int:
        return self.head_num * self.v_head_dim * self.dtype.itemsize

    def _k_layout_dim(self) -> int:
        return self._k_token_stride_size() * self.layer_num

    def _v_layout_dim(self) -> int:
        return self._v_token_stride_size() * self.layer_num

    def _init_write_back_staging_buffers(self) -> None:
        """Device staging for the staged ``page_first`` backup, when the platform runs the device
        kernels and both K and V items suit them; else none (``can_use_write_back_jit`` False)."""
        self.staging_page_capacity = self.staging_token_capacity = 0
        self.staging_k_buffer = self.staging_v_buffer = None
        self.can_use_write_back_jit = False
        if (self.layout != HostLayout.PAGE_FIRST or not (_is_cuda or _is_hip)
                or not current_platform.capabilities.hicache_device_kernels):
            return
        item_bytes = [self.head_num * dim * self.dtype.itemsize for dim in (self.head_dim, self.v_head_dim)]
        if not all([can_use_write_back_jit_kernel(element_size=n) for n in item_bytes]):
            return
        self.staging_page_capacity = min(self.page_num, _WRITE_BACK_STAGING_PAGE_CHUNK)
        self.staging_token_capacity = self.staging_page_capacity * self.page_size
        dtype, device = storage_dtype(self.dtype), self.device_pool.device
        self.staging_k_buffer, self.staging_v_buffer = (
            torch.empty((self.staging_token_capacity, self.layer_num, self.head_num, dim), dtype=dtype, device=device)
            for dim in (self.head_dim, self.v_head_dim)
        )
        self.can_use_write_back_jit = True

    # ---- checks on what the ops read ------------------------------------------------------
    def _op_cell(self, io_backend) -> tuple[HostLayout, IOBackend] | None:
        """This copy's cell when sgl-kernel's ops serve it, None when the IO table's routine
        does; ValueError for a cell the table lacks (naming the layouts it supports)."""
        layout = HostLayout.parse(self.layout)
        io = self.io_backend if io_backend is None else IOBackend.parse(io_backend)
        resolve_io(self.kind, layout, io)
        return (layout, io) if (layout, io) in self._OP_CELLS else None

    def _host_slots(self) -> int:
        """Slots the host buffers hold, read from K's shape (see ``layout.host_shape``)."""
        shape, layout = self.k_buffer.shape, HostLayout.parse(self.layout)
        if layout is HostLayout.LAYER_FIRST:
            return shape[1]
        return shape[0] * self.page_size if layout is HostLayout.PAGE_FIRST_DIRECT else shape[0]

    def _check_device_pool(self, device_pool) -> None:
        """The device pool's per-layer K and V: ``layer_num`` of each, (slots, heads, dim) with
        this pool's heads and dims and the host buffers' element type."""
        for name, layers, host, dim in (("K", device_pool.k_buffer, self.k_buffer, self.head_dim),
                                        ("V", device_pool.v_buffer, self.v_buffer, self.v_head_dim)):
            if len(layers) != self.layer_num:
                raise ValueError(f"device pool has {len(layers)} {name} layers, this host pool {self.layer_num}")
            want = (self.head_num, dim)
            for t in layers:
                if tuple(t.shape[1:]) != want or t.dtype != host.dtype:
                    raise ValueError(f"device {name} layer is {tuple(t.shape)} {t.dtype}; host holds "
                                     f"(slots, {want[0]}, {want[1]}) {host.dtype}")

    def _check_transfer_uncached(self, device_pool, host_indices, device_indices):
        self._check_device_pool(device_pool)
        host_idx = as_cpu_index(host_indices, "host indices")
        dev_idx = as_cpu_index(device_indices, "device indices")
        if host_idx.numel() != dev_idx.numel():
            raise ValueError(f"host indices ({host_idx.numel()}) and device indices ({dev_idx.numel()}) differ in length")
        check_page_aligned(host_idx, self.page_size, "host indices")
        check_page_aligned(dev_idx, self.page_size, "device indices")
        check_in_range(host_idx, 0, self._host_slots(), "host indices")
        check_in_range(dev_idx, 0, device_pool.k_buffer[0].shape[0], "device indices")
        return host_idx, dev_idx

    # ---- device <-> host ----------------------------------------------------------------
    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id: int, io_backend=None) -> None:
        """Copy layer ``layer_id`` of the named pages host -> device (K, then V).

        Mutates only ``device_pool``'s slots ``device_indices`` of that layer.
        """
        cell = self._op_cell(io_backend)
        if cell is None:
            return super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)
        host_idx, dev_idx = self._check_transfer(device_pool, host_indices, device_indices)
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id {layer_id} outside [0, {self.layer_num})")
        device_k, device_v = device_pool.k_buffer[layer_id], device_pool.v_buffer[layer_id]
        if cell[1] is IOBackend.KERNEL:
            for src, dst, item_size, layout_dim in ((self.k_buffer, device_k, self._k_token_stride_size(), self._k_layout_dim()),
                                                    (self.v_buffer, device_v, self._v_token_stride_size(), self._v_layout_dim())):
                transfer_kv_per_layer_mla_pf_lf(src=src, dst=dst, src_indices=host_idx, dst_indices=dev_idx,
                                                layer_id=layer_id, item_size=item_size, src_layout_dim=layout_dim)
        else:  # the direct ops size each copy from its first tensor: K and V go apart
            for src, dst in ((self.k_buffer, device_k), (self.v_buffer, device_v)):
                transfer_kv_per_layer_direct_pf_lf(src_ptrs=[src], dst_ptrs=[dst], src_indices=host_idx,
                                                   dst_indices=dev_idx, layer_id=layer_id, page_size=self.page_size)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend=None) -> None:
        """Copy every layer of the named pages device -> host (K, then V). Mutates only host
        slots ``host_indices``."""
        cell = self._op_cell(io_backend)
        if cell is None:
            return super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)
        host_idx, dev_idx = self._check_transfer(device_pool, host_indices, device_indices)
        if cell[1] is IOBackend.DIRECT:
            for layers, dst in ((device_pool.k_buffer, self.k_buffer), (device_pool.v_buffer, self.v_buffer)):
                transfer_kv_all_layer_direct_lf_pf(src_ptrs=layers, dst_ptrs=[dst], src_indices=dev_idx,
                                                   dst_indices=host_idx, page_size=self.page_size)
        elif self.can_use_write_back_jit:
            for ptrs, staging, dst in ((device_pool.k_data_ptrs, self.staging_k_buffer, self.k_buffer),
                                       (device_pool.v_data_ptrs, self.staging_v_buffer, self.v_buffer)):
                jit_transfer_hicache_all_layer_mla_staged_lf_pf(ptr_src=ptrs, src_indices=dev_idx, dst_indices=host_idx,
                                                                staging=staging, dst=dst, page_size=self.page_size)
        else:
            for ptrs, dst, item_size, layout_dim in (
                (device_pool.k_data_ptrs, self.k_buffer, self._k_token_stride_size(), self._k_layout_dim()),
                (device_pool.v_data_ptrs, self.v_buffer, self._v_token_stride_size(), self._v_layout_dim()),
            ):
                transfer_kv_all_layer_mla_lf_pf(src_layers=ptrs, dst=dst, src_indices=dev_idx, dst_indices=host_idx,
                                                item_size=item_size, dst_layout_dim=layout_dim,
                                                num_layers=self.layer_num)


def get_mha_host_pool_cls(device_pool) -> type[MHATokenToKVPoolHost]:
    """The host pool class for an MHA device pool: the asymmetric one when K and V head dims differ."""
    if device_pool.head_dim != device_pool.v_head_dim:
        return AsymmetricMHATokenToKVPoolHost
    return MHATokenToKVPoolHost
