"""`specdec chat`: the session's turns against fresh generations of the whole conversation (greedy),
the context's overflow, Ctrl-C, a model without a chat template, and the command driven through a
pseudo-terminal. On the tiny random Gemma 3 with the character tokenizer, whose template renders a
message as `<role>content|`."""

import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest

import specdec
from specdec import Engine
from specdec.chat import ChatSession, turn_line
from specdec.cli import main
from specdec.errors import InvalidRequestError, SpecdecError

from helpers import make_char_tokenizer, make_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 512  # make_tiny_hf's max_position_embeddings


@pytest.fixture(scope="module")
def chat_engine(tiny_folder):
    """What `specdec chat --model tiny_folder --dtype float32` loads: prompt lookup drafts."""
    return Engine.load(str(tiny_folder), dtype="float32")


def fresh(engine, session, max_tokens):
    """Plain decoding of the session's conversation as it stands, rendered from nothing."""
    ids = session.render(session.messages[:-1])
    return engine.generate(prompt_ids=ids, max_new_tokens=max_tokens, speculative=False)


def test_each_turn_equals_a_fresh_generate_of_the_whole_conversation(chat_engine):
    session = ChatSession(chat_engine, system="be brief", max_tokens=12)
    first = session.ask("hello there")
    assert first.reused == 0 and first.token_ids == fresh(chat_engine, session, 12).token_ids
    second = session.ask("tell me more")
    reference = fresh(chat_engine, session, 12)
    assert second.token_ids == reference.token_ids and second.text == reference.text
    # The second turn scored only what the first did not leave in the cache: its message and the
    # template around it (at most the first answer's last token besides).
    assert second.reused >= first.prompt_tokens + len(first.token_ids) - 1
    assert second.prompt_tokens == len(session.render(session.messages[:-1]))
    session.system = "be long"  # the first tokens change: nothing is reused, and it stays exact
    third = session.ask("and then?")
    assert third.token_ids == fresh(chat_engine, session, 12).token_ids
    assert third.reused == len("<system>be ")
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 3
    line = turn_line(third)
    assert line.startswith("[12 tokens, ") and "tokens/s" in line and f"prompt {third.prompt_tokens} tokens" in line


def test_reset_forgets_the_turns_but_keeps_the_system_prompt(chat_engine):
    session = ChatSession(chat_engine, system="be brief", max_tokens=8)
    alone = session.ask("hello there")
    session.ask("tell me more")
    session.reset()
    assert session.messages == []
    again = session.ask("hello there")
    assert again.token_ids == alone.token_ids and again.prompt_tokens == alone.prompt_tokens
    assert again.reused == alone.prompt_tokens - 1  # all of it but the token that yields the answer


def test_an_interrupted_answer_keeps_what_was_shown_and_the_next_turn_stays_exact(chat_engine):
    session = ChatSession(chat_engine, max_tokens=40)
    calls = []

    def stop_after_two_steps(emitted, steps):
        calls.append(emitted.text)
        if len(calls) == 3:
            raise KeyboardInterrupt

    turn = session.ask("hello there", on_step=stop_after_two_steps)
    assert turn.finish_reason == "interrupted" and 3 <= len(turn.token_ids) < 40
    assert session.messages[-1] == {"role": "assistant", "content": turn.text}
    assert turn.text.startswith("".join(calls[:2]))
    nxt = session.ask("go on")
    assert nxt.finish_reason != "interrupted" and nxt.token_ids == fresh(chat_engine, session, 40).token_ids


def test_a_conversation_past_the_context_drops_its_oldest_whole_turns(chat_engine):
    max_tokens = 16
    session = ChatSession(chat_engine, system="keep me", max_tokens=max_tokens)
    notices = []
    messages = [f"message {i} " + "abcdefghij" * 14 for i in range(4)]  # ~150 tokens each
    for text in messages[:2]:
        assert session.ask(text, notice=notices.append).dropped == 0
    assert notices == []
    turn = session.ask(messages[2], notice=notices.append)
    assert turn.dropped == 1 and len(notices) == 1
    assert notices[0] == (f"the conversation outgrew the context of {CONTEXT} tokens (with {max_tokens} for the "
                          "answer): dropped the oldest 1 turn")
    assert [m["content"] for m in session.messages[::2]] == messages[1:3]  # whole turns, oldest first out
    assert turn.prompt_tokens + max_tokens <= CONTEXT
    rendered = chat_engine.tokenizer.decode(session.render(session.messages[:-1]))
    assert rendered.startswith("<system>keep me|<user>message 1 ")  # the system prompt stays
    assert turn.token_ids == fresh(chat_engine, session, max_tokens).token_ids
    kept = list(session.messages)
    with pytest.raises(InvalidRequestError, match=f"exceeds the model's context of {CONTEXT} tokens"):
        session.ask("x" * CONTEXT)
    assert session.messages == kept  # a message that cannot fit even alone changes nothing


def test_a_model_without_a_chat_template_is_one_line(tmp_path, tiny_folder, capsys):
    folder, _ = make_tiny_hf(tmp_path, "gemma3")
    make_char_tokenizer(folder)
    (folder / "chat_template.jinja").unlink()  # the same tokenizer without its template
    capsys.readouterr()  # what saving the model printed
    assert main(["chat", "--model", str(folder), "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no chat template" in err and "loading the model" not in err
    # The loaded tokenizer is checked too (a folder whose files might have held one).
    with pytest.raises(SpecdecError, match="has no chat template"):
        ChatSession(Engine.load(str(folder), dtype="float32", drafter="none"))


def test_the_default_model_cannot_chat(capsys):
    assert main(["chat"]) == 2
    assert "has no chat template" in capsys.readouterr().err.strip().splitlines()[-1]


# -- through a pseudo-terminal -----------------------------------------------------------------------

STATS = re.compile(r"\[(\d+) tokens, [^\r\n]*prompt (\d+) tokens, (\d+) reused[^\r\n]*\]\r?\n")


class Terminal:
    """`specdec chat` on a pseudo-terminal: this side types and reads what a user would see."""

    def __init__(self, args: list[str], paced: bool = False):
        paths = [str(Path(specdec.__file__).parents[1])]  # this specdec, wherever the tests import it from
        paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = dict(os.environ, TERM="dumb", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, as in a shell
            # As an interactive shell does for a foreground job: Ctrl-C means SIGINT even where these
            # tests were started with SIGINT ignored (a background job of a script, as CI may run
            # them), which the program would inherit and Python then leaves ignored.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            program = [str(Path(__file__).with_name("chat_paced.py"))] if paced else ["-m", "specdec.cli"]
            os.execve(sys.executable, [sys.executable, *program, "chat", *args], env)
        self.seen = ""  # everything read so far
        self.pos = 0  # where the next `expect` starts looking

    def expect(self, pattern, timeout: float = 120) -> re.Match:
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while not (found := pattern.search(self.seen, self.pos)):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"no {pattern.pattern!r} in {self.seen[self.pos:]!r}")
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # the child closed the terminal
                chunk = b""
            if not chunk:
                raise AssertionError(f"the program ended without {pattern.pattern!r}: {self.seen[self.pos:]!r}")
            self.seen += chunk.decode("utf-8", "replace")
        self.pos = found.end()
        return found

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def ask(self, line: str) -> tuple[str, re.Match]:
        """Type a message; the answer's text as shown (the echoed line left out) and its stats line."""
        self.expect(r"> ")
        self.type(line + "\n")
        self.expect(re.escape(line) + r"\r?\n")
        start = self.pos
        stats = self.expect(STATS)
        return self.seen[start : stats.start()], stats

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def exit_code(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.seen += os.read(self.fd, 4096).decode("utf-8", "replace")
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        raise AssertionError(f"still running: {self.seen[self.pos:]!r}")


def test_chat_in_a_terminal_two_turns_drafts_and_reset(tiny_folder, chat_engine):
    session = ChatSession(chat_engine, max_tokens=10)  # what the terminal must show
    expected = [session.ask(m) for m in ("hello there", "tell me more", "and then?")]
    term = Terminal(["--model", str(tiny_folder), "--dtype", "float32", "--max-tokens", "10"])
    try:
        term.expect("/help lists the commands")
        for turn, message in zip(expected[:2], ("hello there", "tell me more")):
            shown, stats = term.ask(message)
            assert shown.strip("\r\n") == turn.text
            assert stats.groups() == (str(len(turn.token_ids)), str(turn.prompt_tokens), str(turn.reused))
        assert expected[1].reused > expected[0].prompt_tokens  # the second turn reused the first
        term.expect("> ")
        term.type("/drafts\n")
        term.expect(r"drafted tokens marked")
        shown, _ = term.ask("and then?")
        assert re.search("\x1b\\[3[14]m", shown)  # a recovered or bonus token in colour: a terminal
        # The same text, unmarked (a pass's record runs on past the token limit, as generate's does).
        assert re.sub(r"\x1b\[3[124]m|\x1b\[0m", "", shown).strip("\r\n").startswith(expected[2].text)
        term.expect("> ")
        term.type("/reset\n")
        term.expect(r"\(conversation cleared\)")
        term.type("/drafts\n")
        term.expect(r"not marked")
        again, stats = term.ask("hello there")
        alone = expected[0].prompt_tokens
        assert again.strip("\r\n") == expected[0].text and stats.group(2) == str(alone)
        assert stats.group(3) == str(alone - 1)  # the conversation began the same way
        term.expect("> ")
        term.type("/exit\n")
        assert term.exit_code() == 0
    finally:
        term.kill()


def test_chat_in_a_terminal_ctrl_c_overflow_and_ctrl_d(tiny_folder):
    # The first answer paced (tests/chat_paced.py): unpaced, the tiny model's 480 tokens were out
    # before the Ctrl-C landed on loaded machines (clean-clone runs failed so).
    term = Terminal(["--model", str(tiny_folder), "--dtype", "float32", "--max-tokens", "480"], paced=True)
    try:
        term.expect("> ")
        term.type("hi\n")
        term.expect(r"hi\r?\n")
        term.expect(r"[ -~]")  # the answer has begun
        time.sleep(0.1)  # readline has given the terminal its signal keys back
        term.type("\x03")  # Ctrl-C: that answer stops, the program goes on
        stats = term.expect(STATS)
        assert "interrupted" in stats.group(0) and int(stats.group(1)) < 480
        assert "^C" in term.seen[: stats.start()]
        # The partial answer is in the conversation: with 480 tokens kept for the next answer, the
        # context (512) has no room left for it.
        _, stats = term.ask("again")
        assert "the conversation outgrew the context of 512 tokens (with 480 for the answer): dropped the " \
               "oldest 1 turn" in term.seen
        assert int(stats.group(2)) == len("<user>again|<assistant>")
        term.expect("> ")
        term.type("half a line\x03")  # Ctrl-C at the prompt drops the line, not the program
        term.expect("> ")
        term.type("\x04")  # Ctrl-D leaves
        assert term.exit_code() == 0
    finally:
        term.kill()


def test_a_draft_model_reads_only_each_new_turn(chat_engine, tmp_path, monkeypatch):
    """The chat keeps the draft model's read of the earlier turns between them, as it keeps the
    target's row: a turn's first proposal reads its new message (and the template around it), not
    the whole conversation; every answer is still plain decoding's."""
    import torch

    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.models import loader

    draft, _ = loader.load(make_tiny_hf(tmp_path, "gemma3", seed=1)[0], torch.float32, "cpu")
    reads = []
    real = DraftModelDrafter._run

    def counting(self, new, start, last_n, need_hidden=True):
        if last_n == 0:  # a read: context tokens, no head
            reads.append(len(new))
        return real(self, new, start, last_n, need_hidden)

    monkeypatch.setattr(DraftModelDrafter, "_run", counting)
    engine = Engine(chat_engine.model, chat_engine.tokenizer, drafter=DraftModelDrafter(draft, chat_engine.model.config.vocab_size),
                    num_speculative_tokens=3, draft_length="fixed")
    session = ChatSession(engine, system="be brief", max_tokens=12)
    first = session.ask("hello there")
    assert first.token_ids == fresh(chat_engine, session, 12).token_ids and sum(reads) == first.prompt_tokens
    reads.clear()
    second = session.ask("tell me more")
    assert second.token_ids == fresh(chat_engine, session, 12).token_ids
    new = second.prompt_tokens - first.prompt_tokens - len(first.token_ids)
    assert 0 < sum(reads) <= new + 3 < second.prompt_tokens // 2
