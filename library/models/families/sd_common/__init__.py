"""What the three DDPM families (SD1, SD2, SDXL) share: the hooks of their homes
(``hooks.py``; each family's ``home.py`` adds its own metadata strings and built-in names). Not a
family: no ``FAMILY`` here (docs/FAMILIES.md)."""
