"""``python -m tests.acceptance.launch APP [worker options]``: ``celery -A APP worker``
without the ``celery`` umbrella command around it (``APP beat [beat options]``: ``celery
-A APP beat``, likewise).

The worker is the same (Celery's own ``worker`` command, its options, app loading, user
options, and the gevent/eventlet patching ``python -m celery`` applies before anything
else is imported); what is left out is the umbrella's import of every other subcommand
and of every installed ``celery.commands`` plugin (Flower, the shell's prompt toolkit,
``celery pgq``): a quarter to a third of a worker's start-up CPU, paid by each of the
acceptance tests' worker processes. The ``pgq://`` scheme is registered by importing
``pg_transport``, as the installed hook or the ``celery pgq`` plugin otherwise does.
tests/acceptance/test_install.py starts its workers through ``celery`` itself, and
tests/acceptance/test_beat.py its beats with a bad schedule (the error a user sees).
"""

from __future__ import annotations

import sys

from celery import maybe_patch_concurrency


def main(argv: list[str]) -> None:
    maybe_patch_concurrency(argv)  # first: -P gevent patches before the rest is imported
    from celery.app.utils import find_app
    from celery.bin.base import CLIContext

    import pg_transport  # noqa: F401 (registers the pgq:// scheme, as `celery pgq` would)

    app = find_app(argv[0])
    args = argv[1:]
    if args[:1] == ["beat"]:
        from celery.bin.beat import beat as command

        name, args = "beat", args[1:]
    else:
        from celery.bin.worker import worker as command

        name = "worker"
    command.params.extend(app.user_options.get(name, []))
    context = CLIContext(app=app, no_color=False, workdir=None, quiet=False)
    command.main(args=args, prog_name=f"celery {name}", obj=context)


if __name__ == "__main__":
    main(sys.argv[1:])
