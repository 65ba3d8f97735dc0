"""Plugin machinery: loading entry points, the registries of each plugin kind."""
