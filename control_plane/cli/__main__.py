from control_plane.cli.main import main

main()
