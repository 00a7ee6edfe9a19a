from planner.tools.cli import main

raise SystemExit(main())
