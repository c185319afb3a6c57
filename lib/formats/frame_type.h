/* frame_type.h: the names of the frame types of dfl-frame(5), as messages and listings print
 * them. Header-only. */
#ifndef DFL_FRAME_TYPE_H
#define DFL_FRAME_TYPE_H

#include <stddef.h>
#include <stdint.h>

#include "frame.h"

/* "HEADER", "TOKENS", ... for a type of version 1, NULL for any other (the caller says what an
 * unknown type is called where it prints one). */
static inline const char *dfl_frame_type_name(uint32_t t)
{
    switch (t) {
    case DFL_FT_HEADER: return "HEADER";
    case DFL_FT_TOKENS: return "TOKENS";
    case DFL_FT_HIDDEN: return "HIDDEN";
    case DFL_FT_INDEX: return "INDEX";
    case DFL_FT_END: return "END";
    case DFL_FT_NOTE: return "NOTE";
    default: return NULL;
    }
}

#endif
