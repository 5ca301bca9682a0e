from moetrain.plan.cli import main

raise SystemExit(main())
