"""`specdec chat` whose first answer is paced: at least 50 ms after the prefill and after each
decoding step. The tiny test model writes its 480-token answer in well under a second, so on a
loaded machine a test's Ctrl-C could land after the answer had ended; paced, the answer lasts
seconds, and a Ctrl-C typed once it has begun interrupts it. Later answers run at full speed.

    python tests/chat_paced.py chat --model FOLDER ...
"""

import sys
import time

from specdec import chat
from specdec.cli import main

_ask = chat.ChatSession.ask


def _paced_ask(self, text, on_step=None, notice=None):
    first = not getattr(self, "_paced", False)
    self._paced = True

    def step(emitted, steps):
        if first:
            time.sleep(0.05)  # a Ctrl-C here is the same KeyboardInterrupt ask() handles
        if on_step is not None:
            on_step(emitted, steps)

    return _ask(self, text, on_step=step, notice=notice)


chat.ChatSession.ask = _paced_ask

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
