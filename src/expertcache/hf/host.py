"""The host tier under the device slots: experts in host memory, or left in the checkpoint's files.

``host`` (:data:`HOSTS`) says where an offloaded layer's experts live between copies:

* ``memory``: in host memory, the packed tensors transformers loaded (page-locked for a CUDA
  device): a miss is a ``memcpy`` (or a host-to-device copy) out of them;
* ``mmap``: in the checkpoint's ``*.safetensors`` files, mapped read-only; a miss copies the
  expert's byte ranges from the mapping into its slot, so the kernel's page cache is the host
  tier (its LRU under the policy's slots) and a miss whose pages are not resident pays the device;
* ``direct``: in the same files, read with ``O_DIRECT`` into a page-aligned staging buffer, then
  copied into the slot: no page cache, every miss pays the device.

Where an expert's bytes are (:func:`map_file_experts`) is found from the files' headers and
**checked against the loaded model**: for each expert the gate rows, up rows and down matrix
transformers built must equal, byte for byte, tensors (or slices of packed tensors) of that
layer in the files. A checkpoint converted on load in a way that changes the bytes (another
dtype, a transposed layout) is refused in one line; there is no name table per family.

Invariants:

* after :func:`use_files` the layer's ``gate_up_proj`` / ``down_proj`` parameters are NaN
  placeholders of the right shape that hold no memory (one element, expanded), so the loaded
  copy of the experts is released and any use of the stock path on them gives NaN, never a
  silent wrong number; :meth:`FileExperts.materialize` reads real tensors back (the reference
  pass with every expert resident);
* :meth:`FileExperts.copy_into` writes exactly the expert's bytes into the slot, whatever the
  mode (a test compares the slots bitwise with ``memory``);
* counters: every load is counted once in ``loads`` and once in a tier: ``page_cache`` (mmap:
  every page of the expert was resident before the copy, by ``mincore``), ``device`` (mmap: at
  least one page was not; direct: always), with the bytes of the resident and missing pages.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..costmodel.runs import HOSTS
from ..errors import ConfigError
from ..formats.safetensors import checkpoint_files, read_headers
from .pagecache import resident_bytes

ALIGN = 4096
_HOST_ATTR = "_expertcache_host"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass(frozen=True)
class Segment:
    """Bytes ``[offset, offset + nbytes)`` of ``path`` go to byte ``start`` of projection ``part``
    (0: gate_up, 1: down) of one expert's slot."""

    path: str
    offset: int
    nbytes: int
    part: int
    start: int


def check_host(host: str) -> str:
    if host not in HOSTS:
        raise ConfigError(f"host: {host!r} is not one of {', '.join(HOSTS)}")
    return host


def host_of(module: torch.nn.Module) -> "FileExperts | None":
    """The :class:`FileExperts` serving ``module``'s experts from files, or ``None`` (host memory)."""
    return module.__dict__.get(_HOST_ATTR)


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """A NaN tensor of ``shape`` holding one element (expanded): the shape of the experts, none of their memory."""
    return torch.full((), float("nan"), dtype=dtype).expand(*shape)


def use_files(site, files: "FileExperts") -> None:
    """Serve ``site``'s experts from ``files``: the loaded tensors are released (NaN placeholders)."""
    for param in (site.experts.gate_up_proj, site.experts.down_proj):
        param.data = placeholder(param.shape, param.dtype)
    site.experts.__dict__[_HOST_ATTR] = files


# ---------------------------------------------------------------------- finding the bytes
def safetensors_files(folder: Path) -> list[Path]:
    files = checkpoint_files(folder)
    if not files:
        raise ConfigError(f"model {folder}: no *.safetensors file to serve experts from (use --host memory)")
    return files


def _layer_pieces(headers, layer: int, E: int) -> list[dict[str, tuple]]:
    """Per expert of ``layer``: its per-expert tensors and the e-th slices of packed ones, as
    ``name -> (path, offset, nbytes)``."""
    own = re.compile(rf"(?:^|\.)layers\.{layer}\..*?experts\.(\d+)\.(.+)$")
    packed = re.compile(rf"(?:^|\.)layers\.{layer}\..*?experts\.([A-Za-z_][\w.]*)$")
    out: list[dict[str, tuple]] = [{} for _ in range(E)]
    for path, header, start in headers:
        for name, info in header.items():
            if name == "__metadata__" or info["dtype"] not in _DTYPES:  # entries checked by read_headers
                continue
            a, b = info["data_offsets"]
            m = own.search(name)
            if m:
                if int(m.group(1)) < E:
                    out[int(m.group(1))][m.group(2)] = (str(path), start + a, b - a)
                continue
            m = packed.search(name)
            shape = tuple(info.get("shape") or ())
            if m and len(shape) >= 2 and shape[0] == E and (b - a) % E == 0:
                size = (b - a) // E
                for e in range(E):
                    out[e]["packed:" + m.group(1)] = (str(path), start + a + e * size, size)
    return out


def map_file_experts(site, folder: Path, mode: str, device: torch.device) -> "FileExperts":
    """Where each of ``site``'s experts is in the checkpoint's files, checked byte for byte against
    the loaded tensors; refused in one line when the files do not hold those bytes."""
    headers = read_headers(safetensors_files(folder))
    gu, dn = site.experts.gate_up_proj.detach(), site.experts.down_proj.detach()
    E, two_i, _ = gu.shape
    half = two_i // 2
    row = gu[0].numel() // two_i * gu.element_size()  # bytes of one gate_up row
    # the pieces of one expert's slot: (part, start byte in the slot, tensor)
    targets = lambda e: [(0, 0, gu[e, :half]), (0, half * row, gu[e, half:]), (1, 0, dn[e]), (0, 0, gu[e])]
    maps = {}
    reader = _Bytes()
    try:
        every = _layer_pieces(headers, site.layer, E)
        names = _match(every[0], targets(0), reader, site.layer)
        for e, pieces in enumerate(every):
            segs = []
            for (part, start, t), name in zip(targets(e), names):
                if name is None:
                    continue
                path, off, nbytes = pieces.get(name, (None, 0, 0))
                if path is None or not torch.equal(reader.view(path, off, nbytes), _bytes_of(t)):
                    raise ConfigError(
                        f"layer {site.layer}: expert {e}'s bytes in {folder} differ from the loaded model's "
                        "(converted on load?); use --host memory")
                segs.append(Segment(path, off, nbytes, part, start))
            maps[e] = segs
    finally:
        reader.close()
    return FileExperts(site.layer, [maps[e] for e in range(E)], (tuple(gu.shape[1:]), tuple(dn.shape[1:])),
                       gu.dtype, mode, device)


def _match(pieces: dict, targets: list, reader: "_Bytes", layer: int) -> list:
    """For expert 0: the piece holding each target's bytes (gate rows, up rows, down; or the whole
    gate_up at once), or a one-line refusal."""
    def find(t):
        want = _bytes_of(t)
        for name, (path, off, nbytes) in pieces.items():
            if nbytes == want.numel() and torch.equal(reader.view(path, off, nbytes), want):
                return name
        return None

    whole = find(targets[3][2])
    names = [None, None, find(targets[2][2]), whole] if whole else [find(t) for _, _, t in targets[:3]] + [None]
    if names[2] is None or (whole is None and None in names[:2]):
        raise ConfigError(
            f"layer {layer}: the checkpoint's files hold no tensors with the loaded experts' bytes (the model "
            "was converted on load: another --dtype, or a transposed layout); use --host memory")
    return names


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class _Bytes:
    """Read-only byte views of files through private mappings (pages shared with the page cache)."""

    def __init__(self):
        self.maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}

    def tensor(self, path: str) -> torch.Tensor:
        if path not in self.maps:
            with open(path, "rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view: torch needs one; never written
            self.maps[path] = (m, torch.frombuffer(m, dtype=torch.uint8))
        return self.maps[path][1]

    def view(self, path: str, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor(path)[offset : offset + nbytes]

    def close(self) -> None:
        maps = [m for m, _ in self.maps.values()]
        self.maps.clear()  # the tensors over the maps go first
        for m in maps:
            try:
                m.close()
            except BufferError:  # a view is still alive: the map goes when it does
                pass


# ---------------------------------------------------------------------- serving misses
class FileExperts:
    """One layer's E experts in checkpoint files, read on a miss into a slot (``mmap`` or ``direct``)."""

    def __init__(self, layer: int, segments: list[list[Segment]], shapes, dtype: torch.dtype, mode: str,
                 device: torch.device):
        if mode not in ("mmap", "direct"):
            raise ConfigError(f"host: files are served by mmap or direct, not {mode!r}")
        self.layer, self.segments, self.shapes, self.dtype, self.mode = layer, segments, shapes, dtype, mode
        self.device = torch.device(device)
        self.num_experts = len(segments)
        self.expert_bytes = sum(s.nbytes for s in segments[0])
        self.paths = sorted({s.path for segs in segments for s in segs})
        self._bytes = _Bytes()
        self._fds: dict[str, int] = {}
        self._staging = None
        self._pinned = None
        self._pinned_ready = None
        if mode == "direct":
            span = max(s.nbytes for segs in segments for s in segs) + 2 * ALIGN
            self._staging_map = mmap.mmap(-1, -(-span // ALIGN) * ALIGN)
            self._staging = torch.frombuffer(self._staging_map, dtype=torch.uint8)
            self._probe_direct()
        self.clear_counters()

    def clear_counters(self) -> None:
        self.loads = self.page_cache = self.device_loads = 0
        self.page_cache_bytes = self.device_bytes = 0

    @property
    def file_bytes(self) -> int:
        return self.expert_bytes * self.num_experts

    def _direct_fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
        return fd

    def _probe_direct(self) -> None:
        seg = self.segments[0][0]
        if getattr(os, "O_DIRECT", None) is None:
            raise ConfigError("host direct: O_DIRECT is not available on this platform; use --host mmap")
        try:
            self._read_direct(seg)
        except OSError as exc:
            raise ConfigError(f"host direct: {seg.path}: O_DIRECT reads refused "
                              f"({errno.errorcode.get(exc.errno, exc.errno)}); use --host mmap") from None

    def _read_direct(self, seg: Segment) -> torch.Tensor:
        """The segment's bytes, read with O_DIRECT into the aligned staging buffer (a view of it)."""
        fd = self._direct_fd(seg.path)
        start = seg.offset - seg.offset % ALIGN
        head = seg.offset - start
        need = head + seg.nbytes
        view = memoryview(self._staging_map)[: -(-need // ALIGN) * ALIGN]
        got = 0
        while got < need:
            n = os.preadv(fd, [view[got:]], start + got)
            if n == 0:
                raise OSError(errno.EIO, f"unexpected end of file at byte {start + got}", seg.path)
            got += n
        view.release()
        return self._staging[head : head + seg.nbytes]

    def _source(self, seg: Segment, count: bool) -> torch.Tensor:
        if self.mode == "direct":
            if count:
                self.device_bytes += seg.nbytes
            return self._read_direct(seg)
        src = self._bytes.view(seg.path, seg.offset, seg.nbytes)
        if count:
            hit = resident_bytes(src)
            self.page_cache_bytes += min(hit, seg.nbytes)
            self.device_bytes += max(seg.nbytes - hit, 0)
        return src

    def copy_into(self, expert: int, dests, count: bool = True) -> None:
        """Copy ``expert``'s bytes into ``dests`` (its slot: ``gate_up [2I, H]``, ``down [H, I]``)."""
        flat = [_bytes_of_slot(d) for d in dests]
        before = self.device_bytes
        for seg in self.segments[expert]:
            src = self._source(seg, count)
            dst = flat[seg.part][seg.start : seg.start + seg.nbytes]
            if dst.device.type == "cuda":
                self._to_device(src, dst)
            else:
                dst.copy_(src)
        if count:
            self.loads += 1
            if self.mode == "direct" or self.device_bytes > before:
                self.device_loads += 1
            else:
                self.page_cache += 1

    def _to_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Stage through a page-locked buffer: file bytes -> pinned -> device (async on the current stream)."""
        n = src.numel()
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, self.expert_bytes), dtype=torch.uint8, pin_memory=True)
        if self._pinned_ready is not None:
            self._pinned_ready.synchronize()  # the previous copy out of the staging buffer is done
        self._pinned[:n].copy_(src)
        dst.copy_(self._pinned[:n], non_blocking=True)
        self._pinned_ready = torch.cuda.Event()
        self._pinned_ready.record()

    def materialize(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert read back into new packed tensors on ``device`` (not counted)."""
        gu = torch.empty((self.num_experts, *self.shapes[0]), dtype=self.dtype, device=device)
        dn = torch.empty((self.num_experts, *self.shapes[1]), dtype=self.dtype, device=device)
        for e in range(self.num_experts):
            self.copy_into(e, (gu[e], dn[e]), count=False)
        return gu, dn

    def close(self) -> None:
        self._bytes.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _bytes_of_slot(d: torch.Tensor) -> torch.Tensor:
    return d.view(-1).view(torch.uint8)
