# placeholder, rewritten below
