"""Tensor parallelism: one target split over N processes with torch.distributed (`--tensor-parallel N`).

How the weights split (Megatron's scheme, as gpt-fast and vLLM apply it to decoder layers):

| part                    | rank r keeps                                   | after it                    |
|-------------------------|------------------------------------------------|-----------------------------|
| q projection            | the rows of heads [r H/N, (r+1) H/N)           |                             |
| k, v projections        | the rows of its query heads' kv heads (*)      |                             |
| o projection            | the matching input columns                     | all-reduce (sum over ranks) |
| gate, up projections    | a slice of the intermediate rows               |                             |
| down projection         | the matching input columns                     | all-reduce (sum over ranks) |
| output head             | a slice of the vocabulary's rows (padded)      | all-gather of the logits    |
| embedding, norms, rope  | everything (replicated)                        |                             |

(*) With N <= KV heads each rank keeps KV/N of them; with more ranks than kv heads (N a multiple of
KV) each rank keeps the one kv head its query heads share, so a kv head is held by N/KV ranks, as
vLLM replicates them. A rank's KV cache holds only its own kv heads: the cache splits with the heads.

A layer is then attention on the rank's heads -> partial o-projection -> all-reduce -> residual and
norm (replicated) -> partial gated MLP -> all-reduce: two all-reduces a layer, and the output head's
all-gather once a pass. Every rank ends a layer with the same hidden state, so norms and residuals
need no communication.

Who does what. Rank 0 runs everything that is not the target: the engine, the drafter (a draft model
lives on rank 0 only, whole), verification, the tokenizer, the CLI or server. It holds a
`ParallelTarget`, which looks like a `Transformer` to the engine: each call that touches the target
(a forward, the output head on chosen hidden states, a new cache, a cache rollback or row move)
first broadcasts a `Command` describing it (token ids, positions, mask, cache rows and lengths), then
runs it on rank 0's own shard; cache changes (new caches, rollbacks, row moves) ride along with the
next forward or head call, so a step costs two broadcasts whatever its rows' rollbacks. Ranks
1..N-1 (`follow`) receive each command and run the same call on their shards, so all ranks reach
the same collectives in the same order. Rollback is the same `truncate` / `compact` on every rank's
share of the cache.

The quantised paths. The split is made on the float weights, then each rank quantises its own share
(int8 / int4 rows and scales are per output row, so a column-split projection quantises exactly as
the whole; a row-split one, o and down, gets scales over its slice of the inputs). The compiled
one-call decoder layer (`cpu_kernels.decoder_layer`) runs the whole layer, residuals included, in
one C++ call, with no point to stop at for the all-reduces: under tensor parallelism each module
runs by itself (the compiled attention, norms and int8/int4 products are still used per module),
as the all-reduce wrappers below are not projections the fused kernel knows. Splitting that kernel
at its two all-reduce points is left for when a multi-core-per-rank machine makes it worth it.

Numerics. Each rank's o and down products sum over its slice of the inputs and the all-reduce adds
the slices, so the sums are ordered differently than in one process: logits agree with one process
to float rounding (the tests hold them within 1e-5 on a tiny model) and greedy tokens agree where
no near-tie falls within that rounding. Speculative greedy output under N ranks equals plain greedy
output under the same N ranks exactly: a verify pass and a plain step run the same per-rank code.

Launching. `launch` starts ranks 1..N-1 as spawned processes of this one (gloo on the CPU, NCCL on
CUDA, a rendezvous on a free loopback port); under `torchrun --nproc-per-node N` every process runs
the same command and `launch` sends ranks 1..N-1 into `follow` and exits them when rank 0 is done.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import InvalidRequestError, ModelLoadError, SpecdecError
from .kv_cache import KVCache
from .layer import Layer


# -- checks -----------------------------------------------------------------------------------------

def check_world(world: int, device: str) -> None:
    """What can be checked before any model is read: N >= 1, and N ranks' worth of devices."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise InvalidRequestError(f"--tensor-parallel must be an integer >= 1, got {world!r}", "tensor_parallel")
    if world == 1:
        return
    if device.startswith("cuda"):
        have = torch.cuda.device_count()
        if world > have:
            raise InvalidRequestError(f"--tensor-parallel {world} needs {world} CUDA devices, this machine has {have}",
                                      "tensor_parallel")
    elif world > (os.cpu_count() or 1):
        raise InvalidRequestError(f"--tensor-parallel {world} is more ranks than this machine's "
                                  f"{os.cpu_count()} CPU cores", "tensor_parallel")


def check_split(cfg, world: int) -> None:
    """The target's shapes against N ranks: the attention heads must split evenly, and the kv heads
    either split evenly or each be shared by a whole number of ranks."""
    h, kv = cfg.num_heads, cfg.num_kv_heads
    if h % world:
        raise InvalidRequestError(f"--tensor-parallel {world} does not divide the target's {h} attention heads",
                                  "tensor_parallel")
    if kv % world and world % kv:
        raise InvalidRequestError(f"--tensor-parallel {world} neither divides the target's {kv} kv heads nor is "
                                  "a multiple of them", "tensor_parallel")


# -- the split ------------------------------------------------------------------------------------

class AllReduce(Layer):
    """A row-split projection: this rank's partial product, summed over the ranks (in place)."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in / N] -> [..., out], the same on every rank
        y = self.inner(x).contiguous()
        dist.all_reduce(y, group=self.group)
        return y


class GatherHead(Layer):
    """The vocabulary-split output head: each rank scores its `per` ids (the last rank's slice padded
    with zero rows to the same size), the slices are gathered and the padding cut off."""

    def __init__(self, inner: nn.Module, vocab: int, world: int, group):
        super().__init__()
        self.inner = inner
        self.vocab, self.world, self.group = vocab, world, group

    def forward(self, x: Tensor) -> Tensor:  # x: [..., hidden] -> [..., vocab]
        part = self.inner(x).contiguous()  # [..., per]
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


def _bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s slice [lo, hi) of n items split as evenly as possible."""
    return n * rank // world, n * (rank + 1) // world


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    out.weight.data = weight.contiguous()
    if bias is not None:
        out.bias.data = bias.contiguous()
    return out


def _out_rows(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:  # column-parallel: output rows [lo, hi)
    return _linear(linear.weight.data[lo:hi].clone(), None if linear.bias is None else linear.bias.data[lo:hi].clone())


def _in_columns(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:  # row-parallel: input columns [lo, hi)
    if linear.bias is not None:
        raise ValueError("a row-split projection with a bias would add it once per rank")
    return _linear(linear.weight.data[:, lo:hi].clone(), None)


def split_model(model, rank: int, world: int) -> None:
    """Cut a whole float `Transformer` (unfused projections) down to rank `rank`'s share, in place:
    the table in the module docstring. The config stays the whole model's (vocabulary, heads, EOS);
    each attention module knows its own head counts, and `new_cache` sizes the cache by them."""
    cfg = model.config
    check_split(cfg, world)
    d = cfg.head_dim
    heads = cfg.num_heads // world
    kv_heads = max(1, cfg.num_kv_heads // world)
    kv_start = rank * cfg.num_kv_heads // world
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        if attn.qkv_proj is not None or mlp.gate_up_proj is not None:
            raise ValueError("split the model before fusing its projections")
        attn.q_proj = _out_rows(attn.q_proj, rank * heads * d, (rank + 1) * heads * d)
        attn.k_proj = _out_rows(attn.k_proj, kv_start * d, (kv_start + kv_heads) * d)
        attn.v_proj = _out_rows(attn.v_proj, kv_start * d, (kv_start + kv_heads) * d)
        attn.o_proj = _in_columns(attn.o_proj, rank * heads * d, (rank + 1) * heads * d)
        attn.heads, attn.kv_heads = heads, kv_heads
        lo, hi = _bounds(cfg.intermediate_size, world, rank)
        mlp.gate_proj = _out_rows(mlp.gate_proj, lo, hi)
        mlp.up_proj = _out_rows(mlp.up_proj, lo, hi)
        mlp.down_proj = _in_columns(mlp.down_proj, lo, hi)
    # The head gets its own rows even when tied to the embedding (which every rank keeps whole).
    per = -(-cfg.vocab_size // world)
    lo, hi = rank * per, min(cfg.vocab_size, (rank + 1) * per)
    weight = model.lm_head.weight.data
    rows = torch.zeros(per, weight.shape[1], dtype=weight.dtype, device=weight.device)
    rows[: hi - lo] = weight[lo:hi]
    model.lm_head = _linear(rows, None)


def wrap_collectives(model, world: int, group) -> None:
    """After quantising: the o and down projections sum over the ranks, the head gathers."""
    for block in model.layers:
        block.self_attn.o_proj = AllReduce(block.self_attn.o_proj, group)
        block.mlp.down_proj = AllReduce(block.mlp.down_proj, group)
    model.lm_head = GatherHead(model.lm_head, model.config.vocab_size, world, group)


def make_share(builder, rank: int, world: int, quantize: str):
    """This rank's share of the weights, before any process group exists (a model that fails to
    load fails here, on every rank alike): the whole float model from `builder()` on the CPU, split,
    then quantised."""
    from .quant import quantize_model

    model = builder()
    split_model(model, rank, world)
    if quantize != "none":
        quantize_model(model, quantize)
    return model


def load_whole(folder, dtype: torch.dtype):
    """A `Launch.builder` for a model folder: its whole float Transformer on the CPU (each rank
    reads the checkpoint and keeps its share)."""
    from . import loader

    return loader.load(folder, dtype, "cpu")[0]


# -- rank 0's side: the target as the engine sees it ---------------------------------------------------

@dataclass(frozen=True)
class Command:
    """One call on the target, as rank 0 tells the other ranks (tensors travel on the CPU)."""

    op: str  # "forward" | "head" | "stop"
    args: tuple = ()
    free: tuple[int, ...] = ()  # caches rank 0 has let go of since the last command
    # Cache changes since the last command, in order: ("new_cache", id, batch, capacity, dtype) or
    # ("cache", address, method, args). They matter to a rank only at its next forward or head, so
    # they travel with it rather than each costing a broadcast of its own.
    changes: tuple = ()


@dataclass(frozen=True)
class CacheAddress:
    """A cache, or a view of rows [start, stop) of one (`KVCache.rows`), by its id on every rank."""

    id: int
    start: int = 0
    stop: int | None = None


def _to(obj, device):
    """`obj` with its tensors moved to `device` (tuples and dicts walked)."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


class ParallelCache:
    """Rank 0's handle on a KV cache that every rank holds its share of: reads are rank 0's own
    (lengths and positions are the same on every rank), changes are broadcast first."""

    def __init__(self, target: "ParallelTarget", local: KVCache, address: CacheAddress):
        self._target, self.local, self.address = target, local, address

    # Reads: the same on every rank.
    @property
    def lengths(self) -> Tensor:
        return self.local.lengths

    @property
    def positions(self) -> Tensor:
        return self.local.positions

    @property
    def capacity(self) -> int:
        return self.local.capacity

    @property
    def batch(self) -> int:
        return self.local.batch

    @property
    def slot_bytes(self) -> int:
        """A slot of every row on rank 0's device; ranks on the CPU share its memory: all of theirs."""
        ranks = self._target.world if self.local.positions.device.type == "cpu" else 1
        return self.local.slot_bytes * ranks

    def length(self, row: int = 0) -> int:
        return self.local.length(row)

    def check_room(self, new_tokens: int) -> None:
        self.local.check_room(new_tokens)

    # Changes: every rank makes them.
    def _change(self, method: str, *args) -> None:
        getattr(self.local, method)(*args)  # first here: a change rank 0 refuses never reaches the others
        self._target._change("cache", self.address, method, args)

    def truncate(self, length, row: int | None = None) -> None:
        self._change("truncate", length if isinstance(length, int) else torch.as_tensor(length).cpu(), row)

    def compact(self, indices: list[int], start: int, row: int = 0) -> None:
        self._change("compact", list(indices), start, row)

    def move_row(self, src: int, dst: int) -> None:
        self._change("move_row", src, dst)

    def rows(self, stop: int, start: int = 0) -> "ParallelCache":
        a = self.address
        return ParallelCache(self._target, self.local.rows(stop, start),
                             CacheAddress(a.id, a.start + start, a.start + stop))

    def export_row(self, row: int, length: int):
        raise InvalidRequestError("prefix caching does not work under --tensor-parallel (each rank would keep "
                                  "its own share of a prefix); run without it", "tensor_parallel")

    import_row = export_row


class ParallelTarget:
    """A `Transformer` split over N ranks, as rank 0's engine calls it (see the module docstring).

    `config` is the whole model's; `embed_tokens` is rank 0's (whole, replicated); `lm_head` is rank
    0's slice of the head, by which the draft-length rule and a draft model's quantisation see what
    kind of head the target has. `head_columns` has no exact split form: None (screening is off)."""

    def __init__(self, model, world: int, control, processes=()):
        self.model, self.world, self.control = model, world, control
        self.config = model.config
        self.embed_tokens = model.embed_tokens
        self.lm_head = model.lm_head.inner
        self._processes = list(processes)
        self._ids = itertools.count()
        self._freed: list[int] = []
        self._changes: list[tuple] = []
        self._closed = False
        atexit.register(self.close)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _send(self, op: str, *args) -> None:
        if self._closed:
            raise SpecdecError("the tensor-parallel ranks have been stopped")
        freed, self._freed = tuple(self._freed), []
        changes, self._changes = tuple(self._changes), []
        dist.broadcast_object_list([Command(op, _to(args, "cpu"), freed, changes)], src=0, group=self.control)

    def _change(self, *change) -> None:
        if self._closed:
            raise SpecdecError("the tensor-parallel ranks have been stopped")
        self._changes.append(_to(change, "cpu"))

    def new_cache(self, batch: int, capacity: int, device=None, dtype=None) -> ParallelCache:
        cid = next(self._ids)
        self._change("new_cache", cid, batch, capacity, dtype)
        cache = ParallelCache(self, self.model.new_cache(batch, capacity, dtype=dtype), CacheAddress(cid))
        weakref.finalize(cache, self._freed.append, cid)  # the other ranks drop theirs at the next command
        return cache

    def __call__(self, tokens: Tensor, positions: Tensor, cache: ParallelCache, mask: Tensor | None = None,
                 last_n: int | None = None, need_hidden: bool = True) -> tuple[Tensor, Tensor]:
        cache.check_room(tokens.shape[1])  # refused on rank 0 before the other ranks hear of it
        self._send("forward", cache.address, tokens, positions, mask, last_n, need_hidden)
        return self.model(tokens, positions, cache.local, mask=mask, last_n=last_n, need_hidden=need_hidden)

    forward = __call__

    def head(self, hidden: Tensor) -> Tensor:  # hidden: [..., hidden] -> float32 [..., vocab]
        self._send("head", hidden)
        return self.model.head(hidden)

    def head_columns(self, hidden: Tensor, ids: Tensor) -> None:
        return None

    def head_argmax(self, hidden: Tensor) -> None:  # the head is split: its argmax needs every rank's part
        return None

    def close(self) -> None:
        """Stop ranks 1..N-1 and leave the process group (at exit at the latest)."""
        if self._closed:
            return
        try:
            self._send("stop")
        except Exception:  # noqa: BLE001 (the group may already be gone at interpreter exit)
            pass
        self._closed = True
        for p in self._processes:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()


# -- ranks 1..N-1 -------------------------------------------------------------------------------

def follow(model, control) -> None:
    """Run rank 0's commands on this rank's shard until it says stop."""
    device = model.embed_tokens.weight.device
    caches: dict[int, KVCache] = {}

    def resolve(address: CacheAddress) -> KVCache:
        cache = caches[address.id]
        return cache if address.stop is None else cache.rows(address.stop, address.start)

    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            cmd: Command = box[0]
            for cid in cmd.free:
                caches.pop(cid, None)
            if cmd.op == "stop":
                return
            try:
                _run(model, caches, resolve, cmd, device)
            except (SpecdecError, ValueError, IndexError, RuntimeError) as exc:
                # The same call failed the same way on rank 0 (the same shapes and lengths), at the
                # same point, so the ranks stay in step: wait for its next command. (Where a rank
                # is lost, the next broadcast fails too, and that ends this rank.)
                print(f"specdec: rank {dist.get_rank()}: {cmd.op} failed: {exc}", file=sys.stderr)


def _run(model, caches: dict, resolve, cmd: Command, device) -> None:
    for change in _to(cmd.changes, device):
        if change[0] == "new_cache":
            _, cid, batch, capacity, dtype = change
            caches[cid] = model.new_cache(batch, capacity, dtype=dtype)
        else:
            _, address, method, call_args = change
            getattr(resolve(address), method)(*call_args)
    args = _to(cmd.args, device)
    if cmd.op == "forward":
        address, tokens, positions, mask, last_n, need_hidden = args
        model(tokens, positions, resolve(address), mask=mask, last_n=last_n, need_hidden=need_hidden)
    elif cmd.op == "head":
        model.head(args[0])
    else:
        raise ValueError(f"unknown command {cmd.op!r}")


# -- launching ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Launch:
    """What every rank needs to make its shard: a picklable `builder()` -> whole float Transformer
    on the CPU, the quantisation, the device kind and the torch threads per rank."""

    builder: object
    world: int
    quantize: str = "none"
    device: str = "cpu"
    threads: int = 1


def _rank_device(device: str, rank: int) -> str:
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        return f"cuda:{rank}"
    return "cpu"


def _groups(device: str):
    """The collectives' group (NCCL on CUDA, gloo on the CPU) and the control plane's: the
    commands are small pickled objects, sent over gloo on the CPU either way (as vLLM keeps a CPU
    group beside NCCL)."""
    if device.startswith("cuda"):
        return dist.group.WORLD, dist.new_group(backend="gloo")
    return dist.group.WORLD, dist.group.WORLD


def _connect(model, spec: Launch, device: str):
    """A rank's share, once the process group is up: given its collectives, moved to its device;
    and the control group."""
    group, control = _groups(spec.device)
    wrap_collectives(model, spec.world, group)
    return model.to(device).eval(), control


# How long a rank waits in a collective (or for the group to form) before giving up: long, since a
# serving rank 1..N-1 waits for rank 0's next command however idle the server is.
TIMEOUT = timedelta(hours=24)


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _worker(rank: int, spec: Launch, init_method: str, ready) -> None:
    """A spawned rank 1..N-1: make its shard, say so on `ready` (or why not), join the group,
    follow rank 0."""
    torch.set_num_threads(spec.threads)
    try:
        device = _rank_device(spec.device, rank)
        model = make_share(spec.builder, rank, spec.world, spec.quantize)
    except BaseException as exc:
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    ready.put((rank, None))
    dist.init_process_group(_backend(spec.device), init_method=init_method, rank=rank, world_size=spec.world,
                            timeout=TIMEOUT)
    follow(*_connect(model, spec, device))
    dist.destroy_process_group()


def _wait_ready(ready, processes) -> None:
    """Every spawned rank's share made, or a clear error: the group's rendezvous would otherwise
    wait for a rank that died loading its share until the timeout."""
    import queue

    waiting = len(processes)
    while waiting:
        try:
            rank, error = ready.get(timeout=1.0)
        except queue.Empty:
            dead = [i + 1 for i, p in enumerate(processes) if p.exitcode is not None]
            if dead and not ready.empty():  # it said why just before it ended
                continue
            if dead:
                raise ModelLoadError(f"tensor-parallel rank {dead[0]} ended while loading its share "
                                     f"(exit code {processes[dead[0] - 1].exitcode})") from None
            continue
        if error is not None:
            raise ModelLoadError(f"tensor-parallel rank {rank} could not load its share: {error}")
        waiting -= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                    and "MASTER_ADDR" in os.environ)


def launch(spec: Launch) -> ParallelTarget:
    """Rank 0's `ParallelTarget` over `spec.world` ranks.

    Started by `specdec` (no torchrun): ranks 1..N-1 are spawned here and joined at `close`.
    Under torchrun (its RANK / WORLD_SIZE / MASTER_ADDR in the environment): this process is the
    rank torchrun made it; ranks other than 0 make their shard, follow rank 0, and exit here.
    """
    import multiprocessing as mp

    check_world(spec.world, spec.device)
    if dist.is_initialized():
        raise SpecdecError("this process already holds a tensor-parallel target (one process group per "
                           "process): close() it first")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != spec.world:
            raise InvalidRequestError(f"--tensor-parallel {spec.world} under torchrun with {world} processes: "
                                      "give --nproc-per-node the same number", "tensor_parallel")
        rank = int(os.environ["RANK"])
        torch.set_num_threads(spec.threads)
        device = _rank_device(spec.device, int(os.environ.get("LOCAL_RANK", rank)))
        model = make_share(spec.builder, rank, spec.world, spec.quantize)
        dist.init_process_group(_backend(spec.device), timeout=TIMEOUT)
        model, control = _connect(model, spec, device)
        if rank != 0:
            follow(model, control)
            dist.destroy_process_group()
            sys.exit(0)
        return ParallelTarget(model, spec.world, control)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    processes = [ctx.Process(target=_worker, args=(rank, spec, init_method, ready), daemon=True)
                 for rank in range(1, spec.world)]
    for p in processes:
        p.start()
    try:
        torch.set_num_threads(spec.threads)
        device = _rank_device(spec.device, 0)
        model = make_share(spec.builder, 0, spec.world, spec.quantize)
        _wait_ready(ready, processes)
        dist.init_process_group(_backend(spec.device), init_method=init_method, rank=0, world_size=spec.world,
                                timeout=TIMEOUT)
        model, control = _connect(model, spec, device)
    except BaseException:
        for p in processes:
            p.terminate()
        raise
    return ParallelTarget(model, spec.world, control, processes)


__all__ = ["Launch", "ParallelTarget", "check_split", "check_world", "launch", "load_whole"]
