"""`rollflow ...`: the command-line wing. `root` holds the app and the flow commands; `services` (worker,
automations, server), `tools` (show, replay-reward, send, slime import/export), `align`, `bisect` and `bench`
register their commands on it; `common` is what they share."""

from rollflow.flows.cli.root import app, main

__all__ = ["app", "main"]
