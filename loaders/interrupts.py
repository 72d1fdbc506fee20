"""Keep Ctrl-C (and a SIGTERM handler that raises) from being lost inside C code that reads files.

Python runs a signal's handler at the next point the interpreter checks for signals, which can be
inside a C extension's call back into Python. Some of them clear whatever error that call raised
and try another way: safetensors' `get_tensor` then fails with `ValueError: could not determine
the shape of object type 'torch.storage.UntypedStorage'` (or even succeeds), and the
KeyboardInterrupt is gone. `InterruptGuard` wraps the SIGINT and SIGTERM handlers for the length of
a load, remembers what they raised, and raises it again at `check()` or on exit, in place of any
other error, so an interrupt always ends as the interrupt.
"""

import signal
import threading

SIGNALS = tuple(
    s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None
)


class InterruptGuard:
    """`with InterruptGuard() as guard: ... guard.check() ...`

    Only the main thread can set handlers; elsewhere (ComfyUI's worker thread) the guard does
    nothing, as signals are handled in the main thread there anyway. Handlers that are not Python
    callables (SIG_IGN, SIG_DFL) are left alone.
    """

    def __init__(self):
        self.raised: BaseException | None = None
        self._saved = {}

    def __enter__(self):
        self.raised = None
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                previous = signal.getsignal(sig)
                if callable(previous):
                    self._saved[sig] = previous
                    signal.signal(sig, self._wrap(previous))
        return self

    def _wrap(self, previous):
        def handler(signum, frame):
            try:
                previous(signum, frame)
            except BaseException as exc:
                if self.raised is None:
                    self.raised = exc
                raise

        return handler

    def check(self) -> None:
        """Raise the interrupt a handler raised, if one did (and some C code swallowed it)."""
        if self.raised is not None:
            raise _fresh(self.raised)

    def __exit__(self, exc_type, exc, tb):
        for sig, previous in self._saved.items():
            signal.signal(sig, previous)
        self._saved.clear()
        pending, self.raised = self.raised, None
        if pending is not None and exc is not pending:
            raise _fresh(pending) from None
        return False


def _fresh(exc: BaseException) -> BaseException:
    """`exc` without the traceback it got in the handler: that one leads (through the handler
    frame's caller) to the frame the signal interrupted, which holds whatever the C code was
    reading (a view of a memory-mapped file) for as long as the exception lives."""
    return exc.with_traceback(None)
