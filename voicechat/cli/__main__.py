from voicechat.cli.main import main

raise SystemExit(main())
