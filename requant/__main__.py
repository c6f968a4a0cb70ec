from requant.cli import main

main()
