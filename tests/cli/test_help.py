"""``polytrain train --help``: a group per strategy, the chosen one's alone; parse-only, fast."""

import re

import pytest

from polytrain.cli import build_parser, main, train
from polytrain.cli.options import flag_value
from polytrain.cli.train import config_from_args
from polytrain.errors import ConfigError
from polytrain.strategies.base import strategy_names

SHARED = "shared strategy options"


def help_sections(*args: str, capsys) -> dict[str, str]:
    """``train *args`` (with --help among them) cut into sections: title -> the text under it.

    The usage and description, ahead of every title, are under "".
    """
    with pytest.raises(SystemExit) as exit_:
        main(["train", *args])
    assert exit_.value.code == 0
    parts = re.split(r"^(\S[^\n]*):\n", capsys.readouterr().out, flags=re.M)
    return {"": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def listed(section: str) -> list[str]:
    """The flags a section lists, in order (not those its description names)."""
    body = section if section.startswith("  -") else section.partition("\n\n")[2]
    return re.findall(r"^  (--[\w-]+)", body, flags=re.M)


def one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def own_flags(strategy: str) -> set[str]:
    build_parser()
    return {opt.flag for opt in train._flags.values() if strategy in opt.owners}


def test_train_help_has_a_group_per_strategy_with_its_description_and_options(capsys):
    sections = help_sections("--help", capsys=capsys)
    shared = listed(sections[SHARED])
    # Exactly the flags of more than one strategy (--staleness: byteps and hetpipe;
    # --no-colocate: byteps and herring).
    build_parser()
    assert sorted(shared) == sorted(o.flag for o in train._flags.values() if len(o.owners) > 1)
    assert "--staleness" in shared
    for name in strategy_names():
        section = sections[f"{name} options"]
        assert not section.startswith("  --"), f"{name}: no description"
        assert set(listed(section)) == own_flags(name) - set(shared), name
    assert one_line(sections["hetpipe options"]).startswith(
        "HetPipe (Park et al., USENIX ATC 2020): virtual workers of pipelined stages")
    assert one_line(sections["ddp options"]).startswith(  # reST markup left out
        "Data parallelism with torch.nn.parallel.DistributedDataParallel over the workers. ")
    assert listed(sections["ddp options"]) == ["--find-unused-parameters"]
    assert one_line(sections["single options"]).endswith("No options of its own.")
    assert "--policy" in listed(sections["hetpipe options"])
    # The shared flag is named in each owner's group, and its help gives each one's meaning.
    for name in ("byteps", "hetpipe"):
        assert re.search(r"Also [-\w, ]*--staleness[-\w, ]*, under shared strategy options",
                         one_line(sections[f"{name} options"]))
    assert "[byteps] with --async" in one_line(sections[SHARED])
    assert "[hetpipe] D, how many waves a virtual worker" in one_line(sections[SHARED])
    # Owners whose meaning is the same are tagged together, and it is said once.
    costs = one_line(sections[SHARED]).partition("--layer-costs COSTS ")[2]
    assert costs.startswith("[hetpipe, pipetransformer] what a layer costs")
    assert costs.count("what a layer costs") == 1


def test_every_flag_is_listed_once_and_the_usage_names_the_groups(capsys):
    sections = help_sections("--help", capsys=capsys)
    flags = [flag for section in sections.values() for flag in listed(section)]
    assert len(flags) == len(set(flags)) and flags.count("--staleness") == 1
    usage = sections[""].partition("\n\n")[0]
    assert one_line(usage).endswith("[--devices SPEC] [model options] [strategy options]")
    assert "--partition-bytes" not in usage and "--staleness" not in usage


def test_model_options_keep_their_group_and_gpt_moe_has_its_own(capsys):
    sections = help_sections("--help", capsys=capsys)
    assert listed(sections["model options"]) == ["--seq-len", "--d-model", "--layers", "--heads"]
    assert "mixtures of experts" in sections["gpt-moe options"]
    assert "--experts" in listed(sections["gpt-moe options"])


@pytest.mark.parametrize("args", [["--strategy", "hetpipe", "--help"],
                                  ["--strategy=hetpipe", "-h"],
                                  ["--help", "--strategy", "hetpipe"]])  # read ahead of --help
def test_strategy_help_shows_that_strategys_options_alone(args, capsys):
    sections = help_sections(*args, capsys=capsys)
    titles = list(sections)
    assert titles.index("hetpipe options") < titles.index("other strategy options")
    assert "byteps options" not in sections and SHARED not in sections
    hetpipe = listed(sections["hetpipe options"])
    # In HetPipeOptions' order, the shared --staleness with hetpipe's own meaning and metavar.
    assert hetpipe[:3] == ["--policy", "--inflight", "--staleness"]
    assert set(hetpipe) == own_flags("hetpipe")
    assert "--staleness D " in sections["hetpipe options"]
    assert "with --async" not in sections["hetpipe options"]
    assert "--partition-bytes" not in "".join(sections.values())
    others = sorted(n for n in strategy_names() if n != "hetpipe" and own_flags(n))
    assert one_line(sections["other strategy options"]).startswith(
        f"{', '.join(others)} have options of their own: pass --strategy NAME --help")


def test_an_unknown_strategys_help_is_the_whole_help(capsys):
    # The help, not an error: the --strategy line lists the names, and a run names them too.
    sections = help_sections("--strategy", "nope", "--help", capsys=capsys)
    assert f"one of {', '.join(strategy_names())}" in one_line(sections["options"])
    assert {f"{n} options" for n in strategy_names()} <= set(sections)
    assert SHARED in sections and "other strategy options" not in sections


@pytest.mark.parametrize("chosen", [None, "hetpipe", "byteps", "ddp", "nope"])
def test_the_help_layout_does_not_change_what_parses(chosen):
    args = ["train", "--strategy", "hetpipe", "--staleness", "2", "--partition-bytes", "64",
            "--no-predict", "--async", "--expert-parallel", "2", "--experts", "4"]
    shaped = ["train"] + (["--strategy", chosen] if chosen else [])
    assert vars(build_parser(shaped).parse_args(args)) == vars(build_parser().parse_args(args))


def test_a_hidden_flag_of_another_strategy_is_still_refused_naming_its_owner():
    args = ["train", "--strategy", "hetpipe", "--partition-bytes", "64"]
    with pytest.raises(ConfigError, match=r"--partition-bytes is an option of byteps, not of "
                                          r"strategy 'hetpipe'.*pick --strategy byteps"):
        config_from_args(build_parser(args).parse_args(args))
    args = ["train", "--strategy", "moe", "--staleness", "1"]
    with pytest.raises(ConfigError, match=r"--staleness is an option of byteps, hetpipe, not of "
                                          r"strategy 'moe'"):
        config_from_args(build_parser(args).parse_args(args))


def test_flag_value_reads_the_last_value_given():
    assert flag_value(["--strategy", "a", "--steps", "3", "--strategy=b"], "--strategy") == "b"
    assert flag_value(["--strategy"], "--strategy") is None
    assert flag_value(["--strategys", "x"], "--strategy") is None


@pytest.mark.parametrize("args, unknown", [
    (["plan", "--device", "cuda"], "--device cuda"),  # train's: it was read as plan's --devices
    (["plan", "--dev", "cuda"], "--dev cuda"),
    (["train", "--foo"], "--foo"),
    (["launch", "--max-restarts", "2", "job.py"], "--max-restarts"),
])
def test_an_unknown_or_prefix_option_is_refused_with_the_subcommands_usage(args, unknown, capsys):
    # Prefixes were taken for options, and unknown options came with the top level's usage.
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: polytrain {args[0]} "), err
    assert f"polytrain {args[0]}: error: unrecognized arguments: {unknown}\n" in err


@pytest.mark.parametrize("argv, args", [
    (["s.py", "--", "-1"], ["--", "-1"]),         # argparse dropped this '--'
    (["s.py", "a", "--", "b"], ["a", "--", "b"]),
    (["--workers", "2", "--", "s.py", "a"], ["a"]),  # the launcher's own '--'
    (["s.py"], []),
])
def test_launch_passes_the_scripts_arguments_as_given(argv, args, monkeypatch):
    # `python s.py -- -1` gives the script ['--', '-1']; `polytrain launch s.py -- -1` gave it
    # ['-1'], which a script that reads what follows '--' as positionals took otherwise.
    import polytrain.cli.launch as cli_launch
    given = []
    monkeypatch.setattr(cli_launch, "launch_script", lambda script, a, **_: given.append(a))
    assert main(["launch", *argv]) == 0
    assert given == [args]
