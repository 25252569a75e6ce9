"""What the bench's runner and its peers' adapters (`peers.py`) share: the records a bench run
produces (`Settings`, `Run`, `PromptInfo`, `BenchResult`), the device sync around a timed call and
the note a GGUF conversion logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .configs import BenchConfig


@dataclass
class Settings:
    model: str = "default"
    max_tokens: int = 128
    dtype: str = "auto"  # the default target's; a configuration's dtype= overrides it
    quantize: str = "none"
    device: str = "cpu"
    repeats: int = 1
    warmup: int = 1
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # sampled runs: prompt i of repeat r draws with seed + 1000 * r + i
    ref_src: str | None = None  # another specdec tree, for ref@ configurations
    clock: str = "wall"  # a key of runner.CLOCKS


@dataclass
class Run:
    """One generation of one configuration on one prompt."""

    config: str
    prompt_id: str
    group: str
    repeat: int
    prompt_tokens: int
    new_tokens: int
    wall_s: float  # the whole generate call, prefill included (CPU seconds with clock="cpu")
    token_ids: list[int]
    peak_memory: int | None = None  # bytes: peak RSS during the run (CPU) or CUDA max allocated
    # specdec only (None / 0 for peers, which do not expose them):
    prefill_s: float | None = None
    target_forwards: int | None = None  # prefill included
    drafts: int = 0  # verify steps that had at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    tested_tokens: int = 0  # draft positions verified: the accepted ones + the first rejected one
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_s: float = 0.0  # time spent in the drafter's propose()
    identical: bool | None = None  # output == its baseline's on the same prompt and repeat
    first_divergence: int | None = None  # first differing token index when not identical

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class PromptInfo:
    id: str
    group: str
    tokens: int


@dataclass
class BenchResult:
    settings: Settings
    configs: list[BenchConfig]  # baselines added, in run order
    baselines: dict[str, str]  # configuration label -> its plain baseline's label
    targets: dict[str, str]  # configuration label -> what it runs on, in words
    prompts: list[PromptInfo]
    runs: list[Run]
    skipped: dict[str, str]  # configuration label -> why it did not run
    memory_kind: str
    machine: dict
    interrupted: str | None = None  # set when Ctrl-C ended the run early
    counterparts: dict[str, str] = field(default_factory=dict)  # ref@ label -> this tree's same configuration


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load_progress(log):
    def progress(done: int, total: int) -> None:
        if done == 0:
            log("converting the GGUF file once (later loads are fast)")

    return progress
