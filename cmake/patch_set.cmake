# dflash_apply_patches(SRC PATCH...): apply patch files to a llama.cpp source tree, in the order
# given. Safe to run again on a patched tree: the first application keeps each touched file's
# original as <file>.dflash-orig, and a later run restores the originals of every file its patches
# touch once, before the first patch, so a tree patched by an older version of a patch gets the
# current one, and two patches of one call may touch the same file (the second applies on top of
# the first). A tree patched without a backup is left alone when the patch is already applied (its
# reverse applies cleanly). A patch that applies neither way is a fatal error. Used by
# cmake/apply_patches.cmake (CPU), server/apply_patches.cmake and hip_kernels/apply_patch.cmake.
function(dflash_apply_patches SRC)
  # GNU patch if present, else git apply with a git dir that does not exist (so that a repository
  # around SRC, or a broken .git file in a vendored submodule, is never consulted).
  find_program(PATCH_EXE patch)
  find_program(GIT_EXE git)
  if(PATCH_EXE)
    # --force: never guess that a patch is reversed (--batch would); -F0: no fuzz
    set(forward ${PATCH_EXE} -p1 --force -F0 --silent -d "${SRC}" -i)
    set(reverse ${PATCH_EXE} -p1 --force -F0 --silent --reverse --dry-run -d "${SRC}" -i)
    set(check ${PATCH_EXE} -p1 --force -F0 --silent --dry-run -d "${SRC}" -i)
  elseif(GIT_EXE)
    set(git ${GIT_EXE} --git-dir=${SRC}/.dflash-no-git apply -p1)
    set(forward ${git})
    set(reverse ${git} --reverse --check)
    set(check ${git} --check)
  else()
    message(FATAL_ERROR "dflash patches: neither patch nor git found (apt-get install patch)")
  endif()

  # every file the patches touch back to its original, once, before the first patch
  set(restored_files "")
  foreach(p IN LISTS ARGN)
    file(READ "${p}" text)
    string(REGEX MATCHALL "\n\\+\\+\\+ b/[^\t\n]+" targets "${text}")
    foreach(t IN LISTS targets)
      string(REGEX REPLACE "^\n\\+\\+\\+ b/" "" t "${t}")
      list(FIND restored_files "${t}" seen)
      if(EXISTS "${SRC}/${t}.dflash-orig" AND seen EQUAL -1)
        configure_file("${SRC}/${t}.dflash-orig" "${SRC}/${t}" COPYONLY)
        list(APPEND restored_files "${t}")
      endif()
    endforeach()
  endforeach()

  foreach(p IN LISTS ARGN)
    get_filename_component(name "${p}" NAME)
    file(READ "${p}" text)
    string(REGEX MATCHALL "\n\\+\\+\\+ b/[^\t\n]+" targets "${text}")
    set(restored "")
    foreach(t IN LISTS targets)
      string(REGEX REPLACE "^\n\\+\\+\\+ b/" "" t "${t}")
      list(FIND restored_files "${t}" seen)
      if(NOT seen EQUAL -1)
        set(restored " (restored ${t} from its .dflash-orig first)")
      endif()
    endforeach()
    execute_process(COMMAND ${reverse} "${p}" WORKING_DIRECTORY "${SRC}"
                    RESULT_VARIABLE already OUTPUT_QUIET ERROR_QUIET)
    if(already EQUAL 0)
      message(STATUS "dflash patch ${name}: already applied")
      continue()
    endif()
    execute_process(COMMAND ${check} "${p}" WORKING_DIRECTORY "${SRC}"
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "dflash patch ${name} does not apply to ${SRC}:\n${out}${err}\n"
                          "The patch set targets the llama.cpp vendored by llama-cpp-python 0.3.36.")
    endif()
    foreach(t IN LISTS targets)
      string(REGEX REPLACE "^\n\\+\\+\\+ b/" "" t "${t}")
      if(NOT EXISTS "${SRC}/${t}.dflash-orig")
        configure_file("${SRC}/${t}" "${SRC}/${t}.dflash-orig" COPYONLY)
      endif()
    endforeach()
    execute_process(COMMAND ${forward} "${p}" WORKING_DIRECTORY "${SRC}"
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "dflash patch ${name} failed on ${SRC}:\n${out}${err}")
    endif()
    message(STATUS "dflash patch ${name}: applied${restored}")
  endforeach()

endfunction()
