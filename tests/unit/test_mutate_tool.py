"""tools/mutate.py's bookkeeping: which multi-process tests judge a mutant, and which earlier
verdicts a resumed run keeps."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutate_tool", ROOT / "tools/mutate.py")
mutate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutate)


def test_spawned_tests_are_found_by_method_then_name_then_star():
    spawned = {"Gather.send": ["a"], "send": ["b"], "*": ["c"]}
    assert mutate._spawned_tests(spawned, "pkg.mod.xǁGatherǁsend__mutmut_3") == ["a"]
    assert mutate._spawned_tests(spawned, "pkg.mod.xǁOtherǁsend__mutmut_3") == ["b"]
    assert mutate._spawned_tests(spawned, "pkg.mod.x_send__mutmut_12") == ["b"]
    assert mutate._spawned_tests(spawned, "pkg.mod.x_recv__mutmut_1") == ["c"]
    assert mutate._spawned_tests({"send": ["b"]}, "pkg.mod.x_recv__mutmut_1") is None


def test_a_resumed_run_keeps_only_the_kills_made_on_the_same_source(tmp_path):
    log = tmp_path / "spawned.log"
    assert mutate._earlier_kills(log, "new") == {}  # no log yet
    log.write_text("m.x_f__mutmut_1: killed\n"          # before any header: source unknown
                   "# source old\n"
                   "m.x_f__mutmut_2: killed\n"
                   "# source new\n"
                   "m.x_f__mutmut_3: killed\n"
                   "m.x_f__mutmut_4: survived\n"
                   "m.xǁCǁg__mutmut_5: timeout\n"
                   "# source old\n"
                   "m.x_f__mutmut_6: killed\n"
                   "# source new\n"
                   "m.x_f__mutmut_7: killed\n")
    assert mutate._earlier_kills(log, "new") == {"m.x_f__mutmut_3": "killed", "m.xǁCǁg__mutmut_5": "timeout",
                                                 "m.x_f__mutmut_7": "killed"}
    assert mutate._earlier_kills(log, "old") == {"m.x_f__mutmut_2": "killed", "m.x_f__mutmut_6": "killed"}


def test_a_survivor_is_confirmed_against_the_tests_mapped_to_its_function():
    stats = {"pkg.mod.xǁCǁsend": ["t.py::b", "t.py::a"], "pkg.mod.x_f": []}
    assert mutate._mapped_tests(stats, "pkg.mod.xǁCǁsend__mutmut_12") == ["t.py::a", "t.py::b"]
    assert mutate._mapped_tests(stats, "pkg.mod.x_f__mutmut_1") is None
    assert mutate._mapped_tests(stats, "pkg.mod.x_g__mutmut_1") is None
