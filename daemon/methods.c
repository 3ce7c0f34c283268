#include "daemon/methods.h"

const em_method_info em_methods[EM_METHOD_COUNT] = {
#define METHOD_ROW(METHOD, name_, listener_, access_, ordering_, payload_)                    \
    {                                                                                         \
        .method = EMBER__METHOD__##METHOD,                                                    \
        .name = #METHOD,                                                                      \
        .listener = EM_METHOD_LISTENER_##listener_,                                           \
        .access = EM_METHOD_ACCESS_##access_,                                                 \
        .ordering = EM_METHOD_ORDERING_##ordering_,                                           \
        .payload = EM_METHOD_PAYLOAD_##payload_,                                              \
        .admit = EM_METHOD_ADMIT_##payload_(name_),                                           \
        .request = &ember__##name_##_request__descriptor,                                      \
        .response = &ember__##name_##_response__descriptor,                                    \
        .handler = em_handle_##name_,                                                          \
    },
    EM_METHODS(METHOD_ROW)
#undef METHOD_ROW
};

const em_method_info *em_method_find(int method)
{
    for (size_t i = 0; i < EM_METHOD_COUNT; i++)
        if ((int)em_methods[i].method == method)
            return &em_methods[i];
    return NULL;
}
