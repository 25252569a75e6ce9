"""The peers `specdec bench` compares against, each behind the runner's interface (`new_pass()`,
`generate(ids, max_new) -> Run`): HF transformers (plain, prompt lookup, an assistant model),
llama-cpp-python (plain, prompt lookup) and llama.cpp's `llama-speculative` program; and
`load_peers`, which builds them for a bench's configurations or says why one is skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import torch

from ..errors import SpecdecError
from .common import Run, Settings, load_progress, sync
from .configs import BenchConfig


class HFRunner:
    """HF transformers `generate`, greedy: plain, prompt lookup, or with an assistant model."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, config: BenchConfig, model, eos_ids: list[int], device: str, assistant=None):
        self.config = config
        self.model = model
        self.eos_ids = eos_ids
        self.device = device
        self.assistant = assistant

    def new_pass(self) -> None:
        pass  # HF's candidate generators keep no state across generate calls

    def generate(self, ids: tuple[int, ...], max_new: int) -> Run:
        from transformers import GenerationConfig

        o = self.config.options
        extra: dict = {}
        if self.config.kind == "hf-lookup":
            extra = {"prompt_lookup_num_tokens": o["k"], "max_matching_ngram_size": o["n"]}
        elif self.config.kind == "hf-assist":
            extra = {"num_assistant_tokens": o["k"],
                     "num_assistant_tokens_schedule": "heuristic" if o.get("adaptive") else "constant"}
        # A fresh config, not the model's: greedy, no sampling knobs, the same EOS set as specdec.
        gc = GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=0,
                              eos_token_id=self.eos_ids or None,
                              pad_token_id=self.eos_ids[0] if self.eos_ids else 0, **extra)
        inputs = torch.tensor([list(ids)], device=self.device)
        kwargs = {"assistant_model": self.assistant} if self.assistant is not None else {}
        sync(self.device)
        start = self.clock()
        with torch.inference_mode():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=gc, **kwargs)
            new = out[0, len(ids):].tolist()
        wall = self.clock() - start
        return Run(self.config.label, "", "", 0, len(ids), len(new), wall, new)


class LlamaCppRunner:
    """llama-cpp-python on a GGUF file, greedy: plain, or with its prompt-lookup drafter."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, config: BenchConfig, gguf: Path, threads: int, n_ctx: int, eos_ids: list[int]):
        import llama_cpp

        o = config.options
        kwargs = dict(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                      n_gpu_layers=0, verbose=False)
        if config.kind == "llama-cpp-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            kwargs["draft_model"] = LlamaPromptLookupDecoding(max_ngram_size=o["n"], num_pred_tokens=o["k"])
            # Drafting needs every position's logits; llama-cpp-python 0.3.x turns that on for a
            # draft model but sizes its logits buffer from the argument, so a prompt longer than
            # one batch overflows it unless the argument says so too.
            kwargs["logits_all"] = True
        self.config = config
        self.llm = llama_cpp.Llama(**kwargs)
        self.eos = set(eos_ids) | {int(self.llm.token_eos())}

    def new_pass(self) -> None:
        pass

    def generate(self, ids: tuple[int, ...], max_new: int) -> Run:
        # reset(): forget the previous prompt, so every run prefills its whole prompt (llama.cpp
        # would otherwise reuse a cached common prefix, which the other configurations do not).
        self.llm.reset()
        new: list[int] = []
        start = self.clock()
        for token in self.llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            new.append(int(token))
            if new[-1] in self.eos or len(new) >= max_new:
                break
        wall = self.clock() - start
        return Run(self.config.label, "", "", 0, len(ids), len(new), wall, new)


class LlamaSpeculativeRunner:
    """llama.cpp's `llama-speculative` program (target + draft model, greedy), one process per run.

    It takes text, so the prompt's ids go as their text with the special tokens spelled out (the
    program parses them back); its own log gives the timings (prompt encoding + decoding, not the
    model loads) and the draft counts. It prints text, not ids: the output is tokenised again with
    the target's tokenizer, so identity with plain decoding is as exact as that round trip.
    """

    def __init__(self, config: BenchConfig, binary: str, gguf: Path, draft: Path, threads: int, n_ctx: int,
                 tokenizer):
        self.config, self.binary, self.gguf, self.draft = config, binary, gguf, draft
        self.threads, self.n_ctx, self.tokenizer = threads, n_ctx, tokenizer

    def new_pass(self) -> None:
        pass

    def command(self, prompt: str, max_new: int) -> list[str]:
        t = str(self.threads)
        return [self.binary, "-m", str(self.gguf), "-md", str(self.draft), "-p", prompt, "-n", str(max_new),
                "-c", str(self.n_ctx), "-t", t, "-tb", t, "-td", t, "-tbd", t, "--spec-draft-n-max", str(self.config.k),
                "--temp", "0", "--top-k", "1", "--seed", "0", "-ngl", "0", "-ngld", "0"]

    def generate(self, ids: tuple[int, ...], max_new: int) -> Run:
        prompt = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        res = subprocess.run(self.command(prompt, max_new), capture_output=True, text=True, errors="replace")
        log = res.stdout + "\n" + res.stderr
        timing = {k: re.search(rf"{k}\s+(\d+) tokens in\s+([\d.]+) seconds", log) for k in ("encoded", "decoded")}
        if res.returncode != 0 or None in timing.values():
            tail = " | ".join(log.strip().splitlines()[-3:])
            raise SpecdecError(f"{self.config.label}: llama-speculative failed (exit {res.returncode}): {tail}")
        counts = {k: int(m.group(1)) for k in ("n_drafted", "n_accept") if (m := re.search(rf"{k}\s*=\s*(\d+)", log))}
        # stdout: the prompt's pieces, then the output's, between blank lines.
        text = res.stdout
        start = text.find(prompt)
        text = text[start + len(prompt):] if start >= 0 else text
        text = text.split("\n\n\n", 1)[0].removesuffix("\n\n")
        new = self.tokenizer.encode_plain(text) if text else []
        decoded = int(timing["decoded"].group(1))
        wall = float(timing["encoded"].group(2)) + float(timing["decoded"].group(2))
        # It may overshoot -n by an accepted draft; its rate counts every token it decoded.
        run = Run(self.config.label, "", "", 0, len(ids), decoded, wall, new[:max_new])
        run.draft_tokens, run.accepted_tokens = counts.get("n_drafted", 0), counts.get("n_accept", 0)
        return run


def llama_speculative_binary(config: BenchConfig) -> str | None:
    explicit = config.options.get("bin") or os.environ.get("SPECDEC_LLAMA_SPECULATIVE")
    if explicit:
        return explicit if Path(explicit).expanduser().is_file() else None
    return shutil.which("llama-speculative")


def load_peers(settings: Settings, configs: list[BenchConfig], device: str, canon, tokenizer, eos: list[int],
               prompt_ids: list[tuple[int, ...]], runners: dict, described: dict[str, str], skipped: dict[str, str],
               log) -> None:
    """The peers' runners (into `runners`, what each runs in words into `described`); a peer that
    cannot run here goes into `skipped` with the reason, logged."""
    from ..models import loader

    hf_models: dict[str, object] = {}
    for c in configs:
        why = None
        if settings.temperature > 0 and c.family != "specdec":
            why = "peers run greedy only here (their samplers differ from specdec's)"
        elif c.family == "hf":
            dtype = canon(str(c.options.get("dtype", "float32")))
            if dtype not in hf_models:
                log(f"loading the HF transformers model ({dtype})")
                hf_models[dtype] = load_hf(loader.resolve(settings.model, load_progress(log)), dtype, device)
            assistant = None
            if c.kind == "hf-assist":
                log(f"loading the HF assistant model {c.options['model']} ({dtype})")
                assistant = load_hf(loader.resolve(c.options["model"], load_progress(log)), dtype, device)
            runners[c.label] = HFRunner(c, hf_models[dtype], eos, device, assistant)
            described[c.label] = f"HF transformers {dtype}"
        elif c.kind == "llama-spec":
            why = _load_llama_speculative(settings, c, tokenizer, prompt_ids, runners, described)
        elif c.family == "llama-cpp":
            why = _load_llama_cpp(settings, c, eos, prompt_ids, runners, described, log)
        if why:
            skipped[c.label] = why
            log(f"skipping {c.label}: {why}")


def _load_llama_speculative(settings: Settings, c: BenchConfig, tokenizer, prompt_ids, runners: dict,
                            described: dict[str, str]) -> str | None:
    """The llama-speculative peer into `runners`, or why it cannot run."""
    binary = llama_speculative_binary(c)
    gguf, draft = gguf_for(settings, BenchConfig(c.label, "llama-cpp", {})), gguf_for(settings, c)
    if binary is None:
        return ("llama.cpp's llama-speculative program was not found (bin=PATH, $SPECDEC_LLAMA_SPECULATIVE "
                "or the PATH)")
    if gguf is None or draft is None or not gguf.is_file() or not draft.is_file():
        return "needs the target and the draft model as GGUF files"
    if tokenizer is None:
        return "needs the target's tokenizer"
    threads = int(c.options.get("threads") or torch.get_num_threads())
    n_ctx = max(len(ids) for ids in prompt_ids) + settings.max_tokens + c.k + 8
    runners[c.label] = LlamaSpeculativeRunner(c, binary, gguf, draft, threads, n_ctx, tokenizer)
    described[c.label] = f"llama.cpp llama-speculative {gguf.name} + {draft.name}"
    return None


def _load_llama_cpp(settings: Settings, c: BenchConfig, eos: list[int], prompt_ids, runners: dict,
                    described: dict[str, str], log) -> str | None:
    """The llama-cpp-python peer into `runners`, or why it cannot run."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    except OSError as exc:  # installed, but its shared library is missing or does not load
        return f"llama-cpp-python cannot load its library ({exc})"
    gguf = gguf_for(settings, c)
    if gguf is None or not gguf.is_file():
        return f"needs a GGUF file: add :model=PATH.gguf ({gguf or settings.model} is not one)"
    threads = int(c.options.get("threads") or torch.get_num_threads())
    n_ctx = max(len(ids) for ids in prompt_ids) + settings.max_tokens + max(c.k or 0, 16) + 8
    log(f"loading llama.cpp on {gguf.name} ({threads} threads)")
    runners[c.label] = LlamaCppRunner(c, gguf, threads, n_ctx, eos)
    described[c.label] = f"llama.cpp {gguf.name}"
    return None


def gguf_for(settings: Settings, config: BenchConfig) -> Path | None:
    """The GGUF file a llama.cpp peer runs: model=PATH, else the target when it is a GGUF."""
    from ..models import loader

    from ..models import presets

    if config.options.get("model"):
        model = config.options["model"]
        return presets.path(model) if presets.is_preset(model) else Path(model).expanduser()
    if settings.model == "default":
        return loader.default_model_path()
    if presets.is_preset(settings.model):
        return presets.path(settings.model)
    path = Path(settings.model).expanduser()
    return path if path.suffix.lower() == ".gguf" else None


def load_hf(folder: Path, dtype: str, device: str):
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise SpecdecError(f"HF peers need transformers: {exc}") from exc
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"HF transformers cannot load {folder}: {exc}") from exc
    return model.to(device).eval()


