from roll.parity.cli import main

raise SystemExit(main())
