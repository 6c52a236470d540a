"""``tkcc campaign --tolerance`` starts its engine validating in tolerance mode: under ``auto`` a reference that
reproduces its own bits keeps the tier exact and refuses every inexact pass the search proposes."""
from argparse import Namespace

from tkcc.commands.campaign_cmd import compile_args


def _args(**kw):
    return Namespace(**{"compile_workers": None, "kernel_cache": None, "engine_arg": [], "tolerance": False, **kw})


def test_tolerance_search_validates_in_tolerance_unless_the_engine_args_say_how():
    assert "--validation" not in compile_args(_args())
    out = compile_args(_args(tolerance=True))
    assert out[out.index("--validation") + 1] == "tolerance"
    given = _args(tolerance=True, engine_arg=["--validation", "exact"])
    assert "--validation" not in compile_args(given)  # the user's own engine flag stands alone
    assert "--validation" not in compile_args(_args(tolerance=True, engine_arg=["--validation=exact"]))
