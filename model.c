/* model.c */
#include "strata.h"
