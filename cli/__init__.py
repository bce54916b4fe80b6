"""The `drelay` command line: the user's entry point, the top layer, above pipelines/ and deploy/.

    main.py      the entry point (`drelay = cli:main`): builds the parser of the command
                 asked for (all of COMMANDS for `drelay --help`), turns bad input (`DRelayError`)
                 into one line on stderr and exit status 2
    options.py   flags and flag parsing shared by several commands (not a command)
    <command>.py one thin module per command: `add_parser(subparsers)` registers it and sets
                 `run(args) -> int`; the work happens in the packages below

Adding a command (serve, tune, plan, export, submit, …): write `cli/<name>.py` with
`add_parser(sub)` that calls `sub.add_parser("<name>", …)` and `set_defaults(run=run)`, then add
"<name>" to `COMMANDS` in main.py. Only the command a user runs is imported, so a light command
(jobs, submit, plan, serve) starts in a fraction of a second; import heavy dependencies (Ray,
deploy/) inside `run` to keep it so.

May import: every pipelines package, drelay_model, and deploy (lazily, inside functions). A command
module never imports another command module (tests/test_layering.py checks).
"""

from cli.main import guarded, main

__all__ = ["guarded", "main"]
