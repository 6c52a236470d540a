"""A fake timer for the tuners' tests: timing decisions are tested with a clock that says what is fastest."""


def every_nth_fastest(period: int, fastest: int):
    """(clock, calls): ``clock(fn)`` runs ``fn`` and reports 1.0 for the ``fastest``-th of every ``period`` calls
    (a tuner trying each of ``period`` configs per group: that config wins every group), 2.0 otherwise; ``calls``
    holds one entry per call."""
    calls = []

    def clock(fn):
        fn()
        calls.append(1)
        return 1.0 if (len(calls) - 1) % period == fastest else 2.0

    return clock, calls
