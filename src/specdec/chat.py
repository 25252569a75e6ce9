"""`specdec chat`: one model kept loaded, a conversation turn by turn.

A `ChatSession` holds the conversation (the system prompt and whole user/assistant turns) and one
target cache row that outlives the turns. Each turn renders the whole conversation afresh through
the model's chat template, keeps the cached slots of the longest token prefix it shares with what
the row already holds (the earlier turns, usually everything but the new message and the end of the
last answer) and prefills only the rest (`Engine.prefill` starts where the row's length stands).
The keys and values of a slot depend only on the tokens up to it and their positions, so the
answer is the one `Engine.generate` gives for the fresh rendering: the reuse is exact by
construction, and where the template renders an answer differently from the ids the model emitted
(another tokenisation of the same text, a stop string's cut), the shared prefix is just shorter.
A drafter that reads the target's hidden state of every prompt token (EAGLE) gets the whole prompt
scored each turn; a draft model keeps its own read of the earlier turns the same way (`keep_within`).

The context: a turn needs its rendering plus `max_tokens` for the answer within the model's
`max_position`. When the conversation outgrows that, the oldest whole turns (a user message with
its answer) are dropped, the system prompt kept, and the caller is told once (`notice`); a message
that does not fit even alone is refused. The cache row grows on demand (doubling), so a model with
a long context does not preallocate it.

Ctrl-C during an answer ends that answer: what was shown stays in the conversation (nothing, if it
came before the first token), and the cache row is cut back to the slots written before the
interrupted call, which are exact.

`run` is the terminal front end (`specdec chat`): input() with readline's line editing where the
standard library has it, the commands of `HELP`, each answer streamed, then one line of its speed
and acceptance. `/drafts` marks the drafted tokens as `specdec generate --show-drafts` does
(`cli._show_drafts`, step by step).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

from . import builder
from .cli import _progress, _show_drafts, add_decoding_arguments, decoding_settings, load_engine, sampling_from_args
from .engine import Emitted, Engine, Stats, Step
from .errors import InvalidRequestError, SpecdecError
from .models import loader
from .models.kv_cache import KVCache
from .prefix_cache import SHARED, common_prefix
from .sampling import SamplingParams
from .tokenizer import check_text, lacks_chat_template

HELP = """commands:
  /system TEXT  set the system prompt (/system alone removes it); the conversation is kept
  /reset        forget the conversation (the system prompt stays)
  /drafts       mark each answer's drafted tokens on or off: [accepted] {recovered} <bonus>
  /help         this list
  /exit         leave (Ctrl-D too); Ctrl-C stops an answer and comes back here"""

DEFAULT_MAX_TOKENS = 512  # an answer's allowance: chat answers run longer than generate's default


def no_template() -> SpecdecError:
    return SpecdecError("this model has no chat template, so it cannot chat: use an instruct model, e.g. "
                        "--model qwen2.5-coder-1.5b-instruct (`make qwen-coder`), or `specdec generate`")


@dataclass
class Turn:
    """One answer, and how its prompt was made."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "interrupted"
    stats: Stats
    prompt_tokens: int  # the whole conversation as rendered for this turn
    reused: int  # of those, tokens whose keys and values the earlier turns left in the cache
    dropped: int  # oldest turns dropped to fit the context before this one


class ChatSession:
    """A conversation with one engine's target (see the module docstring)."""

    def __init__(self, engine: Engine, *, system: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                 sampling: SamplingParams | None = None, stop: list[str] | tuple[str, ...] = ()):
        if engine.tokenizer is None or not engine.tokenizer.chat_template:
            raise no_template()
        limit = engine.model.config.max_position
        if not 1 <= max_tokens < limit:
            raise InvalidRequestError(f"--max-tokens must be in [1, {limit}) for this model's context of "
                                      f"{limit} tokens", "max_tokens")
        self.engine = engine
        self.system = system
        self.max_tokens = max_tokens
        self.sampling = sampling or SamplingParams()
        self.stop = list(stop)
        self.messages: list[dict] = []  # whole turns: user, assistant, user, assistant, ...
        self._cache: KVCache | None = None
        self._held: list[int] = []  # the tokens whose keys and values fill the cache row's first slots
        if engine.drafter is not None and engine.drafter.needs.reads:
            engine.drafter.keep_within(SHARED)  # a draft model's read of the earlier turns is kept too

    def reset(self) -> None:
        """Forget the conversation; the system prompt stays (and its slots, for the next turn)."""
        self.messages = []

    def render(self, messages: list[dict]) -> list[int]:
        """The token ids of the system prompt and `messages`, ready for the assistant's reply."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return self.engine.tokenizer.encode_chat(system + messages)

    def fit(self, user: dict) -> tuple[list[int], int]:
        """The rendering of the conversation with `user` appended, after dropping the oldest whole
        turns while it and the answer's allowance exceed the context; and how many were dropped."""
        limit = self.engine.model.config.max_position - self.max_tokens
        alone = len(self.render([user]))
        if alone > limit:
            raise InvalidRequestError(
                f"this message takes {alone} tokens; with {self.max_tokens} for the answer (--max-tokens) it exceeds "
                f"the model's context of {self.engine.model.config.max_position} tokens", "messages")
        dropped = 0
        while len(ids := self.render(self.messages + [user])) > limit:
            del self.messages[:2]
            dropped += 1
        return ids, dropped

    def ask(self, text: str, on_step=None, notice=None) -> Turn:
        """Answer `text` as the next turn. `on_step(emitted, steps)` is called after the prefill
        and each decoding step with what it emitted (`Emitted`) and its `Step` records;
        `notice(line)` hears about turns dropped to fit the context. Ctrl-C (KeyboardInterrupt)
        ends the answer early (finish_reason "interrupted")."""
        user = {"role": "user", "content": check_text(text, "the message", "messages")}
        ids, dropped = self.fit(user)
        if dropped and notice is not None:
            notice(f"the conversation outgrew the context of {self.engine.model.config.max_position} tokens "
                   f"(with {self.max_tokens} for the answer): dropped the oldest {dropped} turn"
                   f"{'s' if dropped > 1 else ''}")
        engine = self.engine
        row = engine.new_row(ids, max_new_tokens=self.max_tokens, sampling=self.sampling, stop=self.stop,
                             record_steps=True)
        row.started = time.perf_counter()
        reused = self._reuse(ids, row)
        cache, safe, interrupted = self._cache, reused, False
        try:
            emitted = engine.prefill(row, cache)
            while True:
                safe = min(cache.length(), len(row.context))  # slots the next call cannot spoil
                if on_step is not None:
                    on_step(emitted, row.steps[-1:])
                if row.finished:
                    break
                emitted = engine.step([row], cache).emitted[0]
        except KeyboardInterrupt:
            interrupted = True
        engine.finish(row)
        safe = min(safe, cache.length(), len(row.context))
        cache.truncate(safe)
        self._held = row.context[:safe]
        reply = row.out.text
        if reply or not interrupted:
            self.messages += [user, {"role": "assistant", "content": reply}]
        return Turn(reply, list(row.out.ids), "interrupted" if interrupted else row.out.finish_reason, row.stats,
                    len(ids), reused, dropped)

    def _reuse(self, ids: list[int], row) -> int:
        """Make the cache row hold the longest prefix of `ids` it already holds (at least one
        token left to score), with room for the answer; returns that prefix's length."""
        drafter = row.drafter
        observes = drafter is not None and drafter.needs.observes is not None
        n = 0 if observes else min(common_prefix(self._held, ids), len(ids) - 1)
        room = self.engine.room(row)
        need = len(ids) + self.max_tokens + room + 1
        old = self._cache
        if old is None or old.capacity < need:
            ceiling = self.engine.model.config.max_position + room + 1
            grown = self.engine.new_cache(1, need if old is None else max(need, min(2 * old.capacity, ceiling)))
            if n:
                grown.import_row(old.export_row(0, n), 0)
            self._cache = grown
        self._cache.truncate(n)
        self._held = self._held[:n]
        return n


def turn_line(turn: Turn) -> str:
    """The one line after an answer: its speed, acceptance and how its prompt was made."""
    s = turn.stats
    parts = [f"{s.new_tokens} tokens", f"{s.tokens_per_s:.1f} tokens/s"]
    if s.draft_tokens:
        parts.append(f"acceptance {s.acceptance_rate:.0%} ({s.accepted_tokens}/{s.draft_tokens} drafts, "
                     f"mean accepted length {s.mean_accepted_length:.2f})")
    parts.append(f"prompt {turn.prompt_tokens} tokens, {turn.reused} reused, prefill {s.prefill_s:.2f} s")
    if turn.finish_reason != "stop":
        parts.append({"length": "cut at --max-tokens", "interrupted": "interrupted"}[turn.finish_reason])
    return "[" + ", ".join(parts) + "]"


class Repl:
    """The terminal loop over a `ChatSession`: lines in, answers and commands out."""

    def __init__(self, session: ChatSession, out=None, colour: bool = False):
        self.session = session
        self.out = out or sys.stdout
        self.colour = colour
        self.drafts = False

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def loop(self) -> int:
        self.say("specdec chat: /help lists the commands, /exit or Ctrl-D leaves.")
        while True:
            try:
                if self.turn() is False:
                    return 0
            except EOFError:
                self.say("")
                return 0
            except KeyboardInterrupt:  # at the prompt, or between an answer and the next prompt:
                self.say("")  # drop the line, as a shell does (an answer handles its own)
                continue

    def turn(self) -> bool:
        """Read one line and act on it; False to leave."""
        line = input("> ").strip()
        if not line:
            return True
        if line.startswith("/"):
            return self.command(line) is not False
        self.answer(line)
        return True

    def command(self, line: str) -> bool:
        """Run a /command; False to leave."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.say(HELP)
        elif name == "/reset":
            self.session.reset()
            self.say("(conversation cleared)")
        elif name == "/drafts":
            self.drafts = not self.drafts
            self.say(f"(drafted tokens {'marked: [accepted] {recovered} <bonus>' if self.drafts else 'not marked'})")
        elif name == "/system":
            self.session.system = rest or None
            self.say("(system prompt set)" if rest else "(system prompt removed)")
        else:
            self.say(f"unknown command {name} (/help lists them)")
        return True

    def answer(self, text: str) -> None:
        engine = self.session.engine

        def show(emitted: Emitted, steps: list[Step]) -> None:
            if self.drafts:
                self.out.write(_show_drafts(engine, SimpleNamespace(steps=steps), self.colour))
            else:
                self.out.write(emitted.text)
            self.out.flush()

        try:
            turn = self.session.ask(text, on_step=show, notice=lambda line: self.say(f"({line})"))
        except SpecdecError as exc:
            self.say(f"specdec: error: {exc}")
            return
        if turn.finish_reason == "interrupted":
            self.out.write("^C")
        self.say("")
        print(turn_line(turn), file=sys.stderr, flush=True)


def add_arguments(parser) -> None:
    add_decoding_arguments(parser)
    parser.set_defaults(max_tokens=DEFAULT_MAX_TOKENS)
    parser.add_argument("--system", help="the system prompt (/system TEXT changes it)")


def run(args) -> int:
    for flag, text in (("--system", args.system), *(("--stop", s) for s in args.stop or ())):
        if text is not None:
            check_text(text, flag, None)
    if args.max_tokens < 1:
        raise SpecdecError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sampling = sampling_from_args(args)
    # Before the weights: a model whose files leave no place for a template fails at once (the
    # default model's do); the session checks the loaded tokenizer itself.
    settings = builder.resolve(decoding_settings(args))  # its quantisation: the folder the load reads
    if lacks_chat_template(loader.resolve(args.model, _progress,
                                          settings.quantize if args.tensor_parallel == 1 else "none")):
        raise no_template()
    engine = load_engine(args, settings)
    session = ChatSession(engine, system=args.system, max_tokens=args.max_tokens, sampling=sampling,
                          stop=args.stop or ())
    try:  # line editing and history for input(); its import sets that up, so only here
        import readline  # noqa: F401
    except ImportError:
        pass
    return Repl(session, colour=sys.stdout.isatty()).loop()
