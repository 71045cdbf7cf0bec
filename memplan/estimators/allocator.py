"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.x)
for one device and one stream: what `torch.cuda.max_memory_reserved()` becomes, and whether an
allocation raises out of memory, when a step's allocations and frees are replayed in order.

What it follows, as the allocator does it:
- sizes round up to 512 bytes; requests up to 1 MiB come from the small pool (2 MiB segments),
  larger ones from the large pool (20 MiB segments below 10 MiB, else a segment of the request
  rounded up to 2 MiB);
- best fit: the smallest cached block of the pool that holds the request (the lowest address
  among equal sizes), split when the rest is at least 512 bytes (small pool) or more than 1 MiB
  (large pool); a freed block merges with its free neighbours of the same segment;
- when no cached block fits and a new segment does not fit the capacity, every cached segment
  that is wholly free is released and the allocation is tried once more, else it is out of
  memory;
- expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): one segment per pool
  whose mapped pages (2 MiB small, 20 MiB large) grow at the lowest address with room, blocks
  always split, and out of memory first unmaps the free pages of every cached block.

Streams: each stream has pools of its own (a block freed on one stream serves only that
stream's requests), as FSDP2's all-gather and reduce-scatter buffers are kept apart from the
default stream's. Not modelled: CUDA graphs' private pools, max_split_size_mb,
roundup_power2_divisions and garbage_collection_threshold (the advisor refuses those settings).
Pure Python, no torch."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memplan.errors import UsageError
from memplan.estimators.events import Event

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # the largest small-pool request
SMALL_BUFFER = 2 << 20  # small-pool segment
LARGE_BUFFER = 20 << 20  # segment for a large request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


class AllocatorOutOfMemory(Exception):
    """The allocation does not fit even after the cache is released."""

    def __init__(self, nbytes: int, reserved: int, allocated: int) -> None:
        super().__init__(f"out of memory allocating {nbytes} B ({reserved} B reserved)")
        self.nbytes = nbytes
        self.reserved = reserved
        self.allocated = allocated


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The cudaMalloc size for a request of `size` (rounded) bytes that no cached block holds."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class Block:
    __slots__ = ("size", "ptr", "prev", "next", "allocated", "mapped", "small", "segment", "stream")

    def __init__(
        self, size: int, ptr: int, small: bool, segment: _Expandable | None, stream: int = 0
    ) -> None:
        self.size = size
        self.ptr = ptr
        self.small = small
        self.segment = segment  # the expandable segment the block lies in, else None
        self.stream = stream
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.mapped = True

    @property
    def split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Cached free blocks ordered by (size, address), and unmapped ranges by address."""

    def __init__(self, small: bool, stream: int = 0) -> None:
        self.small = small
        self.stream = stream
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], Block] = {}
        self.unmapped: list[tuple[int, int]] = []  # (address, id) of unmapped blocks
        self.unmapped_blocks: dict[tuple[int, int], Block] = {}

    def insert(self, block: Block) -> None:
        key = (block.size, block.ptr)
        insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        key = (block.size, block.ptr)
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]

    def insert_unmapped(self, block: Block) -> None:
        key = (block.ptr, id(block))
        insort(self.unmapped, key)
        self.unmapped_blocks[key] = block

    def remove_unmapped(self, block: Block) -> None:
        key = (block.ptr, id(block))
        del self.unmapped[bisect_left(self.unmapped, key)]
        del self.unmapped_blocks[key]


class _Expandable:
    """The virtual address range of an expandable segment and which of its pages are mapped."""

    def __init__(self, base: int, page: int, pages: int) -> None:
        self.base = base
        self.page = page
        self.pages = pages
        self.mapped: set[int] = set()


@dataclass(frozen=True)
class AllocatorSettings:
    """What the allocator is allowed and how it behaves. capacity: the bytes its segments may
    hold together (the GPU's memory less what lies outside the allocator), None for no limit;
    device_memory: the GPU's total, which sizes expandable segments' address ranges."""

    capacity: int | None = None
    expandable_segments: bool = False
    device_memory: int = 80 << 30


class CachingAllocator:
    def __init__(self, settings: AllocatorSettings = AllocatorSettings()) -> None:
        self.settings = settings
        self.pools: dict[tuple[int, bool], _Pool] = {}
        self.expandable: dict[tuple[int, bool], list[_Expandable]] = {}
        self.segments: dict[int, Block] = {}  # classic segments by base address
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        # cudaMalloc hands out virtual addresses mostly top-down (seen in H100 traces); the
        # address only breaks ties between cached blocks of one size.
        self._next_address = 1 << 48

    # ------------------------------------------------------------------ public

    def pool(self, stream: int, small: bool) -> _Pool:
        key = (stream, small)
        if key not in self.pools:
            self.pools[key] = _Pool(small, stream)
            self.expandable[key] = []
        return self.pools[key]

    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.pool(stream, small)
        block = self._free_block(pool, size)
        if block is None:
            block = self._new_block(pool, size)
        if block is None:
            self.release_cached()
            block = self._new_block(pool, size)
        if block is None:
            raise AllocatorOutOfMemory(nbytes, self.reserved, self.allocated)
        if self._should_split(block, size):
            block = self._split(pool, block, size)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        pool = self.pools[(block.stream, block.small)]
        for neighbour in (block.prev, block.next):
            self._merge(pool, block, neighbour)
        pool.insert(block)

    def release_cached(self) -> None:
        """torch.cuda.empty_cache(), and the allocator's retry before out of memory."""
        for pool in self.pools.values():
            cached = [pool.blocks[key] for key in pool.keys]
            for block in cached:
                if block.segment is not None:
                    self._unmap(pool, block)
                elif not block.split:
                    pool.remove(block)
                    del self.segments[block.ptr]
                    self.reserved -= block.size

    # ------------------------------------------------------------------ finding a block

    def _free_block(self, pool: _Pool, size: int) -> Block | None:
        i = bisect_left(pool.keys, (size, 0))
        if i == len(pool.keys):
            return None
        block = pool.blocks[pool.keys[i]]
        if block.segment is not None:
            # Best fit counts a block that ends at unmapped pages as the size it can grow to.
            def growable(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            while block.segment is not None and i + 1 < len(pool.keys):
                following = pool.blocks[pool.keys[i + 1]]
                if growable(following) >= growable(block):
                    break
                i, block = i + 1, following
        pool.remove(block)
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.settings.expandable_segments:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _split(self, pool: _Pool, block: Block, size: int) -> Block:
        """The first `size` bytes of `block` as a new block; the rest stays cached."""
        head = Block(size, block.ptr, block.small, block.segment, block.stream)
        head.prev, head.next = block.prev, block
        if block.prev is not None:
            block.prev.next = head
        block.prev = head
        block.ptr += size
        block.size -= size
        pool.insert(block)
        return head

    def _merge(self, pool: _Pool, block: Block, other: Block | None) -> None:
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        if other.mapped:
            pool.remove(other)
        else:
            pool.remove_unmapped(other)
        if block.prev is other:
            block.ptr = other.ptr
            block.prev = other.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
        block.size += other.size

    # ------------------------------------------------------------------ new memory

    def _fits(self, nbytes: int) -> bool:
        capacity = self.settings.capacity
        return capacity is None or self.reserved + nbytes <= capacity

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _new_block(self, pool: _Pool, size: int) -> Block | None:
        if self.settings.expandable_segments:
            return self._grow_expandable(pool, size)
        nbytes = segment_size(size)
        if not self._fits(nbytes):
            return None
        self._next_address -= nbytes + ROUND_LARGE  # segments never touch: no merges across
        block = Block(nbytes, self._next_address, pool.small, None, pool.stream)
        self.segments[block.ptr] = block
        self._reserve(nbytes)
        return block

    # ------------------------------------------------------------------ expandable segments

    def _grow_expandable(self, pool: _Pool, size: int) -> Block | None:
        candidate = self._expandable_candidate(pool, size)
        if not candidate.mapped and not self._map(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            if not self._map(pool, following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        pool.remove(candidate)
        return candidate

    def _expandable_candidate(self, pool: _Pool, size: int) -> Block:
        """The lowest-addressed run of free and unmapped blocks with room for `size`, in an
        existing segment or a new one."""

        def free(b: Block | None) -> bool:
            return b is not None and not b.allocated

        def room(b: Block | None) -> bool:
            total = 0
            while total < size and free(b):
                total += b.size
                b = b.next
            return total >= size

        for key in pool.unmapped:
            block = pool.unmapped_blocks[key]
            if free(block.prev):
                block = block.prev
            if room(block):
                return block
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        memory = self.settings.device_memory
        pages = -(-(memory + memory // 8) // page)
        self._next_address -= pages * page + page
        segment = _Expandable(self._next_address, page, pages)
        self.expandable[(pool.stream, pool.small)].append(segment)
        block = Block(pages * page, segment.base, pool.small, segment, pool.stream)
        block.mapped = False
        pool.insert_unmapped(block)
        return block

    def _map(self, pool: _Pool, block: Block, size: int) -> bool:
        """Map the pages under the first `size` bytes of the unmapped `block`."""
        segment = block.segment
        assert segment is not None
        first = (block.ptr - segment.base) // segment.page
        last = -(-(block.ptr + size - segment.base) // segment.page)
        nbytes = (last - first) * segment.page
        if not self._fits(nbytes):
            return False
        segment.mapped.update(range(first, last))
        pool.remove_unmapped(block)
        block.mapped = True
        if nbytes < block.size:
            rest = Block(
                block.size - nbytes, block.ptr + nbytes, block.small, segment, block.stream
            )
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = nbytes
            pool.insert_unmapped(rest)
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.insert(block)
        self._reserve(nbytes)
        return True

    def _unmap(self, pool: _Pool, block: Block) -> None:
        """Unmap the whole pages inside the free `block`, keeping the partial pages at its ends
        as free blocks."""
        segment = block.segment
        assert segment is not None
        page = segment.page
        start = block.ptr + (-(block.ptr - segment.base)) % page
        end = block.ptr + block.size - (block.ptr + block.size - segment.base) % page
        if end <= start:
            return
        pool.remove(block)
        before, after = start - block.ptr, block.ptr + block.size - end
        if before:
            head = Block(before, block.ptr, block.small, segment, block.stream)
            head.prev, head.next = block.prev, block
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            pool.insert(head)
        if after:
            tail = Block(after, end, block.small, segment, block.stream)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            pool.insert(tail)
        block.ptr, block.size, block.mapped = start, end - start, False
        segment.mapped.difference_update(
            range((start - segment.base) // page, (end - segment.base) // page)
        )
        self.reserved -= end - start
        for neighbour in (block.prev, block.next):
            self._merge(pool, block, neighbour)
        pool.insert_unmapped(block)


@dataclass(frozen=True)
class ReplayResult:
    """What the allocator did over a replayed stream: peaks, and the event at which it ran out
    of memory (None when every allocation succeeded). peak_allocated counts blocks as the
    allocator holds them (max_memory_allocated): a large request whose segment would leave at
    most 1 MiB takes the whole segment. peaks_by: the allocated peak over the events before each
    count asked for (replay's `marks`)."""

    peak_allocated: int
    peak_reserved: int
    oom_index: int | None
    reserved_at: list[int]
    peaks_by: tuple[int, ...] = ()


def replay(
    events: Iterable[Event], settings: AllocatorSettings, marks: Sequence[int] = ()
) -> ReplayResult:
    """Replay a step's allocations and frees through the allocator model, stopping at the first
    allocation that runs out of memory; with the allocated peak reached before each of `marks`
    (event counts, ascending)."""
    allocator = CachingAllocator(settings)
    blocks: dict[int, Block] = {}
    reserved_at: list[int] = []
    pending, peaks = list(marks), []
    for index, event in enumerate(events):
        while pending and pending[0] <= index:
            peaks.append(allocator.peak_allocated)
            pending.pop(0)
        if event.action == "alloc":
            try:
                blocks[event.tensor] = allocator.malloc(event.nbytes, event.stream)
            except AllocatorOutOfMemory:
                return ReplayResult(
                    allocator.peak_allocated, allocator.peak_reserved, index, reserved_at
                )
        else:
            allocator.free(blocks.pop(event.tensor))
        reserved_at.append(allocator.reserved)
    peaks += [allocator.peak_allocated] * len(pending)
    return ReplayResult(
        allocator.peak_allocated, allocator.peak_reserved, None, reserved_at, tuple(peaks)
    )


# PYTORCH_CUDA_ALLOC_CONF settings that change nothing this model predicts.
_NEUTRAL_SETTINGS = ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register")


def parse_alloc_conf(text: str) -> bool:
    """Whether a PYTORCH_CUDA_ALLOC_CONF value ("expandable_segments:True,...") turns expandable
    segments on; a setting the model does not follow is a UsageError naming it."""
    expandable = False
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = (piece.strip() for piece in item.partition(":"))
        if key == "expandable_segments" and value.lower() in ("true", "false"):
            expandable = value.lower() == "true"
        elif key == "backend" and value != "native":
            raise UsageError(
                f"allocator backend {value!r} is not modelled; only PyTorch's native one"
            )
        elif key not in _NEUTRAL_SETTINGS:
            raise UsageError(
                f"allocator setting {item!r} is not modelled: memplan predicts the default "
                "allocator and expandable_segments:True|False"
            )
    return expandable
