from roll.bench.cli import main

raise SystemExit(main())
