from rayfuse.cli import main

raise SystemExit(main())
