from ddplab.cli import main

raise SystemExit(main())
