"""`signals`: Ctrl-C and SIGTERM handled one way by the CLI, the atomic swap and heal: handlers set and put
back, signals ignored or deferred for a block, nothing touched off the main thread."""
from __future__ import annotations

import signal
import threading

import pytest

from normswap import signals


def test_interrupt_raises_keyboard_interrupt_with_the_signal():
    with pytest.raises(KeyboardInterrupt) as e, signals.handled(signals.interrupt, (signal.SIGTERM,)):
        signal.raise_signal(signal.SIGTERM)
    assert e.value.args == (signal.SIGTERM,)


def test_handlers_are_put_back_after_the_block():
    before = {s: signal.getsignal(s) for s in signals.STOPS}
    with signals.held():
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in signals.STOPS)
        signal.raise_signal(signal.SIGINT)   # ignored
    assert {s: signal.getsignal(s) for s in signals.STOPS} == before


def test_deferred_delivers_the_first_signal_after_the_block():
    got = []
    with signals.handled(lambda signum, frame: got.append(signum)):
        with signals.deferred():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
            assert got == []
        assert got == [signal.SIGTERM]


def test_deferred_delivers_it_even_when_the_block_fails():
    with pytest.raises(KeyboardInterrupt), signals.deferred():
        signal.raise_signal(signal.SIGINT)
        raise OSError("the block failed")


def test_off_the_main_thread_nothing_is_set():
    seen = []

    def worker():
        seen.append(signals.install(signal.SIG_IGN))
        with signals.held(), signals.deferred():
            seen.append(signal.getsignal(signal.SIGINT))
    before = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [{}, before]


def test_restore_puts_the_default_back_where_python_had_no_handler():
    previous = signals.install(signal.SIG_IGN, (signal.SIGTERM,))
    signals.restore({signal.SIGTERM: None})
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signals.restore(previous)
