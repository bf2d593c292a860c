from specserve.cli import main

raise SystemExit(main())
