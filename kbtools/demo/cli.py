"""`kb demo` and `kb demo --stop`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from services.runtime.errors import BadInput

DEFAULT_HOME = Path(".kb/demo")


def demo(
    stop: bool = typer.Option(
        False, "--stop", help="Stop every process the demo started (then `kb dev down`)."
    ),
    port: int = typer.Option(
        8080, "--port", min=1, max=65535, help="The API's port (another is taken if busy)."
    ),
    home_dir: str = typer.Option(
        str(DEFAULT_HOME), "--home", help="Where the demo keeps its logs and state."
    ),
) -> None:
    """Tell the refund-policy story on the embedded default and leave the services running.

    Publish, search, a rate-limited provider, a corrupt PDF, ACL and tenant walls, and an
    indexer killed mid-task; prints the operator page's URL at the end."""
    from kbtools.demo.console import Console
    from kbtools.demo.processes import DemoProcesses
    from kbtools.demo.story import Demo

    home = Path(home_dir)
    if home.exists() and not home.is_dir():
        raise BadInput(f"--home {home} is not a directory")
    if stop:
        stopped = DemoProcesses(home).stop_all()
        typer.echo(f"stopped: {', '.join(stopped) or 'nothing was running'}")
        typer.echo("the databases keep running: `kb dev down` stops them", err=True)
        return
    sys.exit(Demo(home.resolve(), Console(), api_port=port).run())
