set(EPMOE_GEMM_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/expert_gemm_fprop.cu
  ${CMAKE_CURRENT_LIST_DIR}/expert_gemm_dgrad.cu
  ${CMAKE_CURRENT_LIST_DIR}/expert_gemm_wgrad.cu
  ${CMAKE_CURRENT_LIST_DIR}/grouped_gemm_fp8.cu
  ${CMAKE_CURRENT_LIST_DIR}/grouped_wgrad_fp8.cu
  ${CMAKE_CURRENT_LIST_DIR}/grouped_gemm_nvfp4.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm_config.cpp)
