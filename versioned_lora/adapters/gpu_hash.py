# mypy: disable-error-code="untyped-decorator"
# (triton.jit is untyped upstream; the kernels are checked by tests/adapters/test_hashing.py instead)
"""The chunked hash of manifest v2 (`hashing`) on a GPU: one Triton kernel, one GPU thread a chunk.

The kernel computes SHA-256 of every chunk of a flat uint8 buffer, given each chunk's start and length
(`hashing.chunk_table`), and writes each chunk's eight state words; the host then folds the chunk digests
of each tensor with one more SHA-256 (`hashing.combine`: a few hundred small hashes, well under a
millisecond). SHA-256 is sequential within a chunk, so the parallelism is the number of chunks: a 349 MB
adapter in 64 KiB chunks is ~5,300 independent hashes.

The padding is SHA-256's own (FIPS 180-4 §5.1.1), applied per chunk inside the kernel: after the chunk's
``L`` bytes one 0x80 byte, zeros, and ``8 L`` as a 64-bit big-endian integer, over ``ceil((L + 9) / 64)``
blocks; message words are read big-endian. Lanes whose chunk is shorter (a tensor's last chunk) stop
updating once their own blocks are done.

The same kernel source runs on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which is how
the tests on a host without a GPU hold it bit for bit to hashlib (tests/adapters/test_hashing.py). This
module imports Triton; the others import it only when a GPU hash is asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from versioned_lora.adapters.hashing import chunk_table, combine

if TYPE_CHECKING:
    import torch

# SHA-256's round constants and initial state (FIPS 180-4 §4.2.2, §5.3.3).
ROUND_CONSTANTS = (
    0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4, 0xAB1C5ED5,
    0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE, 0x9BDC06A7, 0xC19BF174,
    0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F, 0x4A7484AA, 0x5CB0A9DC, 0x76F988DA,
    0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7, 0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967,
    0x27B70A85, 0x2E1B2138, 0x4D2C6DFC, 0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85,
    0xA2BFE8A1, 0xA81A664B, 0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070,
    0x19A4C116, 0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
    0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7, 0xC67178F2,
)  # fmt: skip
INITIAL_STATE = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
# Chunks per program, one GPU thread each: one warp, so even a few thousand chunks spread over every
# multiprocessor (at 128 a program, a 349 MB adapter's 5,300 chunks of 64 KiB filled 42 of an H200's 132).
LANES = 32


@triton.jit
def rotr(x, n: tl.constexpr):  # type: ignore[no-untyped-def]
    return (x >> n) | (x << (32 - n))


@triton.jit
def sha_round(a, b, c, d, e, f, g, h, kw):  # type: ignore[no-untyped-def]
    t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ ((e ^ 0xFFFFFFFF) & g)) + kw
    t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c))
    return t1 + t2, a, b, c, d + t1, e, f, g


@triton.jit
def expand(w0, w1, w9, w14):  # type: ignore[no-untyped-def]
    s0 = rotr(w1, 7) ^ rotr(w1, 18) ^ (w1 >> 3)
    s1 = rotr(w14, 17) ^ rotr(w14, 19) ^ (w14 >> 10)
    return w0 + s0 + w9 + s1


@triton.jit
def word(data, start, length, pos, bits_hi, bits_lo, final, active, slot: tl.constexpr, WORDS: tl.constexpr):  # type: ignore[no-untyped-def]
    # Big-endian message word at byte `pos` of the padded chunk: data bytes below `length`, 0x80 at
    # `length`, zeros after; in the final block, words 14 and 15 carry the bit length.
    if WORDS:
        # `data` is the buffer as int32 and every chunk starts on a multiple of 4: one 4-byte load (a quarter
        # of the load instructions, which bound the byte path), swapped to big-endian; in the word where the
        # chunk ends, the bytes past `length` are cleared and the 0x80 marker put in.
        rem = length - pos
        v = tl.load(data + (start + pos) // 4, mask=active & (rem > 0), other=0).to(tl.uint32, bitcast=True)
        swapped = ((v & 0xFF) << 24) | ((v & 0xFF00) << 8) | ((v >> 8) & 0xFF00) | (v >> 24)
        r = tl.minimum(tl.maximum(rem, 0), 4)
        keep = 0xFFFFFFFF ^ (0xFFFFFFFF >> (8 * r))  # the first r bytes (int64 arithmetic: r may be 4)
        marker = tl.where((rem >= 0) & (rem < 4), 0x80 << (8 * (3 - tl.minimum(r, 3))), 0)
        out = ((swapped.to(tl.int64) & keep) | marker).to(tl.uint32)
    else:
        # (pos * 0, not tl.zeros: under the interpreter, triton.language's own jitted helpers fail when triton
        # was imported before TRITON_INTERPRET was set, as in a test run)
        out = (pos * 0).to(tl.uint32)
        for k in tl.static_range(4):
            p = pos + k
            byte = tl.load(data + start + p, mask=active & (p < length), other=0).to(tl.uint32)
            byte = tl.where(p == length, 0x80, byte).to(tl.uint32)
            out = out | (byte << (24 - 8 * k))
    if slot == 14:
        out = tl.where(final, out | bits_hi, out)
    if slot == 15:
        out = tl.where(final, out | bits_lo, out)
    return out


@triton.jit
def sha256_chunks(data, starts, lengths, out, k, n_chunks, max_blocks, LANES: tl.constexpr, WORDS: tl.constexpr):  # type: ignore[no-untyped-def]
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < n_chunks
    start = tl.load(starts + lane, mask=live, other=0)
    length = tl.load(lengths + lane, mask=live, other=0)
    blocks = (length + 72) // 64  # ceil((length + 9) / 64)
    bits = length * 8
    bits_hi = (bits >> 32).to(tl.uint32)
    bits_lo = (bits & 0xFFFFFFFF).to(tl.uint32)
    h0 = tl.full([LANES], 0x6A09E667, tl.uint32)
    h1 = tl.full([LANES], 0xBB67AE85, tl.uint32)
    h2 = tl.full([LANES], 0x3C6EF372, tl.uint32)
    h3 = tl.full([LANES], 0xA54FF53A, tl.uint32)
    h4 = tl.full([LANES], 0x510E527F, tl.uint32)
    h5 = tl.full([LANES], 0x9B05688C, tl.uint32)
    h6 = tl.full([LANES], 0x1F83D9AB, tl.uint32)
    h7 = tl.full([LANES], 0x5BE0CD19, tl.uint32)
    for j in range(0, max_blocks):
        active = live & (j < blocks)
        final = j == blocks - 1
        base = start * 0 + j * 64
        w0 = word(data, start, length, base + 0, bits_hi, bits_lo, final, active, 0, WORDS)
        w1 = word(data, start, length, base + 4, bits_hi, bits_lo, final, active, 1, WORDS)
        w2 = word(data, start, length, base + 8, bits_hi, bits_lo, final, active, 2, WORDS)
        w3 = word(data, start, length, base + 12, bits_hi, bits_lo, final, active, 3, WORDS)
        w4 = word(data, start, length, base + 16, bits_hi, bits_lo, final, active, 4, WORDS)
        w5 = word(data, start, length, base + 20, bits_hi, bits_lo, final, active, 5, WORDS)
        w6 = word(data, start, length, base + 24, bits_hi, bits_lo, final, active, 6, WORDS)
        w7 = word(data, start, length, base + 28, bits_hi, bits_lo, final, active, 7, WORDS)
        w8 = word(data, start, length, base + 32, bits_hi, bits_lo, final, active, 8, WORDS)
        w9 = word(data, start, length, base + 36, bits_hi, bits_lo, final, active, 9, WORDS)
        w10 = word(data, start, length, base + 40, bits_hi, bits_lo, final, active, 10, WORDS)
        w11 = word(data, start, length, base + 44, bits_hi, bits_lo, final, active, 11, WORDS)
        w12 = word(data, start, length, base + 48, bits_hi, bits_lo, final, active, 12, WORDS)
        w13 = word(data, start, length, base + 52, bits_hi, bits_lo, final, active, 13, WORDS)
        w14 = word(data, start, length, base + 56, bits_hi, bits_lo, final, active, 14, WORDS)
        w15 = word(data, start, length, base + 60, bits_hi, bits_lo, final, active, 15, WORDS)
        a, b, c, d, e, f, g, h = h0, h1, h2, h3, h4, h5, h6, h7
        for r in tl.static_range(4):
            if r > 0:  # rounds 16..63 extend the schedule in place (a rolling window of 16 words)
                w0 = expand(w0, w1, w9, w14)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w0 + tl.load(k + 16 * r + 0))
            if r > 0:
                w1 = expand(w1, w2, w10, w15)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w1 + tl.load(k + 16 * r + 1))
            if r > 0:
                w2 = expand(w2, w3, w11, w0)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w2 + tl.load(k + 16 * r + 2))
            if r > 0:
                w3 = expand(w3, w4, w12, w1)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w3 + tl.load(k + 16 * r + 3))
            if r > 0:
                w4 = expand(w4, w5, w13, w2)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w4 + tl.load(k + 16 * r + 4))
            if r > 0:
                w5 = expand(w5, w6, w14, w3)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w5 + tl.load(k + 16 * r + 5))
            if r > 0:
                w6 = expand(w6, w7, w15, w4)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w6 + tl.load(k + 16 * r + 6))
            if r > 0:
                w7 = expand(w7, w8, w0, w5)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w7 + tl.load(k + 16 * r + 7))
            if r > 0:
                w8 = expand(w8, w9, w1, w6)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w8 + tl.load(k + 16 * r + 8))
            if r > 0:
                w9 = expand(w9, w10, w2, w7)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w9 + tl.load(k + 16 * r + 9))
            if r > 0:
                w10 = expand(w10, w11, w3, w8)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w10 + tl.load(k + 16 * r + 10))
            if r > 0:
                w11 = expand(w11, w12, w4, w9)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w11 + tl.load(k + 16 * r + 11))
            if r > 0:
                w12 = expand(w12, w13, w5, w10)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w12 + tl.load(k + 16 * r + 12))
            if r > 0:
                w13 = expand(w13, w14, w6, w11)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w13 + tl.load(k + 16 * r + 13))
            if r > 0:
                w14 = expand(w14, w15, w7, w12)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w14 + tl.load(k + 16 * r + 14))
            if r > 0:
                w15 = expand(w15, w0, w8, w13)
            a, b, c, d, e, f, g, h = sha_round(a, b, c, d, e, f, g, h, w15 + tl.load(k + 16 * r + 15))
        h0 = tl.where(active, h0 + a, h0)
        h1 = tl.where(active, h1 + b, h1)
        h2 = tl.where(active, h2 + c, h2)
        h3 = tl.where(active, h3 + d, h3)
        h4 = tl.where(active, h4 + e, h4)
        h5 = tl.where(active, h5 + f, h5)
        h6 = tl.where(active, h6 + g, h6)
        h7 = tl.where(active, h7 + h, h7)
    row = out + lane * 8
    tl.store(row + 0, h0, mask=live)
    tl.store(row + 1, h1, mask=live)
    tl.store(row + 2, h2, mask=live)
    tl.store(row + 3, h3, mask=live)
    tl.store(row + 4, h4, mask=live)
    tl.store(row + 5, h5, mask=live)
    tl.store(row + 6, h6, mask=live)
    tl.store(row + 7, h7, mask=live)


@functools.cache
def _round_constants(device: str) -> torch.Tensor:
    import torch

    return torch.tensor(ROUND_CONSTANTS, dtype=torch.uint32, device=device)


class ChunkLayout:
    """The chunk table of buffers laid out in one flat buffer, built once and kept on the buffer's device
    (for a stash: at allocation, off the critical path)."""

    def __init__(self, spans: Sequence[tuple[int, int]], chunk: int, device: torch.device | str) -> None:
        import torch

        starts, lengths, firsts = chunk_table(spans, chunk)
        self.chunk = chunk
        self.firsts = firsts
        self.count = len(starts)
        self.max_blocks = (int(lengths.max()) + 72) // 64 if self.count else 0
        # Every chunk on a 4-byte boundary: the kernel may read whole words (see `word`).
        self.aligned = bool((starts % 4 == 0).all())
        self.starts = torch.from_numpy(starts).to(device)
        self.lengths = torch.from_numpy(lengths).to(device)

    def launch(self, flat: torch.Tensor) -> torch.Tensor:
        """Start hashing every chunk of `flat` on the current stream; returns the (count, 8) uint32 state
        words (complete in stream order)."""
        import torch

        out = torch.empty((self.count, 8), dtype=torch.uint32, device=flat.device)
        if self.count:
            grid = (-(-self.count // LANES),)
            words = self.aligned and flat.numel() % 4 == 0 and flat.data_ptr() % 4 == 0
            data = flat.view(torch.int32) if words else flat
            sha256_chunks[grid](data, self.starts, self.lengths, out, _round_constants(str(flat.device)), self.count,
                                self.max_blocks, LANES=LANES, WORDS=words, num_warps=1)  # fmt: skip
        return out

    def fold(self, words: Any) -> list[str]:
        """Each buffer's hash from the chunk words (a host array of (count, 8) uint32, or its bytes)."""
        digests = digest_bytes(words)
        return [combine(digests[32 * a : 32 * b]) for a, b in zip(self.firsts, self.firsts[1:], strict=False)]


def digest_bytes(words: Any) -> bytes:
    """Chunk digests as SHA-256 writes them: each state word big-endian."""
    import numpy as np

    array = words.cpu().numpy() if hasattr(words, "cpu") else np.asarray(words)
    return array.astype(">u4").tobytes()


def packed_bytes(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The tensors' contiguous bytes in one flat uint8 buffer on their device, each at a multiple of 4 (zero
    bytes between, where a size is not: the kernel then reads whole words), and each one's (offset, nbytes).
    Tensors of one dtype whose sizes are multiples of 4 (a LoRA's, always) take one flatten each and one
    `torch.cat`: per-tensor view chains cost ~10 µs of host time each, milliseconds for 504 tensors."""
    import torch

    if not tensors:
        return torch.empty(0, dtype=torch.uint8), []
    spans: list[tuple[int, int]] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        spans.append((offset, nbytes))
        offset += -(-nbytes // 4) * 4
    if len({t.dtype for t in tensors}) == 1 and all(n % 4 == 0 for _, n in spans):
        return torch.cat([t.detach().reshape(-1) for t in tensors]).view(torch.uint8), spans
    parts: list[torch.Tensor] = []
    for t, (_, nbytes) in zip(tensors, spans, strict=True):
        parts.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
        if nbytes % 4:
            parts.append(torch.zeros(4 - nbytes % 4, dtype=torch.uint8, device=t.device))
    return torch.cat(parts), spans


@functools.lru_cache(maxsize=16)
def layout_for(spans: tuple[tuple[int, int], ...], chunk: int, device: str) -> ChunkLayout:
    """One chunk table per layout: a trainer publishes the same shapes again and again."""
    return ChunkLayout(spans, chunk, device)


class PendingGpuHashes:
    """Chunk hashes launched on the GPU: `result()` waits for them and folds each tensor's."""

    def __init__(self, names: list[str], layout: ChunkLayout, words: torch.Tensor, keep: torch.Tensor) -> None:
        self._names = names
        self._layout = layout
        self._words = words
        self._keep = keep  # the packed bytes, alive until the kernel has read them

    def result(self) -> dict[str, str]:
        out = dict(zip(self._names, self._layout.fold(self._words), strict=True))
        del self._keep
        return out


def start_cuda_hashes(tensors: Mapping[str, torch.Tensor], chunk: int) -> PendingGpuHashes:
    """Launch the chunked hash of every tensor on their GPU (all on one device) and return at once."""
    names = list(tensors)
    flat, spans = packed_bytes([tensors[n] for n in names])
    layout = layout_for(tuple(spans), chunk, str(flat.device))
    return PendingGpuHashes(names, layout, layout.launch(flat), flat)


def hash_cuda_tensors(tensors: Mapping[str, torch.Tensor], chunk: int) -> dict[str, str]:
    """name -> chunked hash of every tensor, computed on their GPU (all tensors on one device)."""
    return start_cuda_hashes(tensors, chunk).result()
