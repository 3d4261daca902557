from shardzoo.cli import main

raise SystemExit(main())
