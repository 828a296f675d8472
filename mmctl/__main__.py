from mmctl.main import main

main()
