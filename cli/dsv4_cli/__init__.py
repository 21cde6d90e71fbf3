"""The `dsv4` command: plan, render, serve, up. The one package that may import every side;
each subcommand imports the side it runs only when it runs (`dsv4 plan`/`render` work in the
operator image, without torch; `dsv4 serve --role router` never imports the worker)."""
