"""The local backend holds Ctrl-C / SIGTERM while it registers a node it just spawned, so that an
interrupted sweep never leaves a node running (harness.run.local._signals_deferred)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from harness.run.local import _signals_deferred


class Boom(Exception): pass

def test_a_signal_in_the_body_reaches_the_handler_after_it():
    def handler(signum, frame): raise Boom
    old = signal.signal(signal.SIGTERM, handler)
    done = []
    try:
        with pytest.raises(Boom):
            with _signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                done.append(True)
        assert done == [True]
    finally:
        signal.signal(signal.SIGTERM, old)
