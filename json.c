/* json.c */
#include "strata.h"
