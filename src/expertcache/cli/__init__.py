"""The ``expertcache`` command: one subcommand per module, registered in :mod:`.main`."""
